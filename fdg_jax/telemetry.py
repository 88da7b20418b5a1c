"""Staleness telemetry: how stale the gradients are that the stages apply.

`Schedule(..., telemetry=True)` keeps, per stash entry, the weights the forward ran at and,
on stage 0, the batch; `Schedule.telemetry(state)` then measures, for each stage that
applies a stale gradient at the next tick, the weight discrepancy and the cosine between
that gradient and the fresh one of the same batch (what telemetry adds to a stash entry:
`StageMath.telemetry_extras`). The methods below are `Schedule`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax.stages import stage_key


class Telemetry:
  """`Schedule`'s telemetry methods (a mixin: they read the schedule's stages and state)."""

  def telemetry(self, state) -> dict:
    """How stale the gradients are that the stages apply at the next tick.

    Needs `Schedule(..., telemetry=True)`, which keeps, per stash entry, the weights the
    forward ran at (D_k copies of stage k's parameters) and, on stage 0, the batch.
    Returns {"weight_discrepancy": [K], "grad_cosine": [K]}, floats or None where stage k
    applies no stale gradient at the next tick (delay 0, or the pipeline still filling)::

      weight_discrepancy: ||theta_now - theta_fwd|| / ||theta_now||, theta_fwd the weights
        the batch's forward ran at (after any forward hook, e.g. weight prediction);
      grad_cosine: the cosine between the stale gradient the stage applies (its stash
        entry and the cotangent waiting for it) and the fresh gradient of the same batch:
        backprop through the whole network at the current weights.
    """
    why = self.plan.kind.staleness_refusal(self.algorithm)
    if why:
      raise ValueError(why)
    if not self.telemetry_enabled:
      raise ValueError("telemetry needs a schedule built with telemetry=True")
    if jax.process_count() > 1:
      raise ValueError("staleness telemetry runs in single-process runs only")
    K, t = self.num_stages, int(state["tick"])
    out = {"weight_discrepancy": [None] * K, "grad_cosine": [None] * K}
    if state["inbox"] is None:
      return out
    home = self.placement.state_shardings[0]
    fresh_inputs = None
    for k in range(K - 1):
      if self.delays[k] == 0 or self.plan.flags(k, t)[1] is not True:
        continue
      grads, discrepancy, b = self._telemetry_fn("applied", k)(
          state["stages"][k], state["inbox"][k]["cot"])
      out["weight_discrepancy"][k] = float(discrepancy)
      if fresh_inputs is None:
        cores = [self.stage_state(state, j) for j in range(K)]
        fresh_inputs = jax.device_put(
            [(c["params"], c["model_state"], c["rng"]) for c in cores], home)
      b = np.int32(b)  # the batch index, from stage k's devices to stage 0's
      x, y, found = self._telemetry_fn("batch", 0)(state["stages"][0], b)
      if not bool(found):
        continue
      out["grad_cosine"][k] = float(self._telemetry_fn("cosine", k)(
          fresh_inputs, x, y, b, jax.device_put(grads, home)))
    return out

  def _telemetry_fn(self, kind: str, k: int):
    key = (kind, k)
    if key in self._telemetry_fns:
      return self._telemetry_fns[key]
    D = self.ring_sizes[k]
    n = self.shapes.core_entry_sizes[k]

    def applied(packed, cot):
      s = self.math.unpack_stage(k, packed)
      slot = s["pops"] % D
      stash = s["stash"]  # rings per leaf here
      entry = tuple(stash["head"] if "head" in stash
                    else self.math.ring_load(k, stash["ring"], slot))
      b = s["stash_batch"][slot]
      grads, _ = self.math.backward(k, s["params"], s["model_state"], s["opt_state"], entry, cot,
                                stage_key(s["rng"], b))
      leaves, treedef = jax.tree.flatten(s["params"])
      theta_fwd = entry[n:n + len(leaves)]
      sq = lambda trees: sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in trees)
      diff = sq([a - f for a, f in zip(leaves, theta_fwd)])
      return grads, jnp.sqrt(diff) / jnp.maximum(jnp.sqrt(sq(leaves)), 1e-30), b

    def batch(packed, b):
      s = self.math.unpack_stage(0, packed)
      hit = s["stash_batch"] == b
      slot = jnp.argmax(hit)
      ring = s["stash"]["ring"]
      x, y = ring[-2][slot], ring[-1][slot]
      return x, y, jnp.any(hit)

    def cosine(inputs, x, y, b, applied_grads):
      def loss(all_params):
        h = x
        for j, (p, (_, ms, rng)) in enumerate(zip(all_params, inputs)):
          h, _ = self.stages[j].apply(p, ms, h, train=True, rng=stage_key(rng, b))
        return self.loss_fn(h, y)
      fresh = jax.grad(loss)([p for p, _, _ in inputs])[k]
      f = [a.astype(jnp.float32) for a in jax.tree.leaves(fresh)]
      g = [a.astype(jnp.float32) for a in jax.tree.leaves(applied_grads)]
      dot = sum(jnp.sum(a * c) for a, c in zip(f, g))
      norm = lambda v: jnp.sqrt(sum(jnp.sum(a * a) for a in v))
      return dot / jnp.maximum(norm(f) * norm(g), 1e-30)

    fn = jax.jit({"applied": applied, "batch": batch, "cosine": cosine}[kind])
    self._telemetry_fns[key] = fn
    return fn
