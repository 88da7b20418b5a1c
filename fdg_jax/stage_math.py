"""What a stage computes when a plan's call reaches it: one definition of a tick's work.

A stage's work at a tick is one pure function of (stage state, arriving activation,
arriving cotangent, whether it forwards, whether it backwards) -> (stage state, activation
to send, cotangent to send, batch updated, metrics) (`StageMath.call`): stage k < K-1 runs
its delayed backward and update (pop the stash entry, vjp, optimizer) and then its forward
(stash the entry, send the output), either or both; the last stage its forward, loss,
gradient and update. Every engine runs these same functions: traced into one program (the
fused and SPMD engines) or jitted per call (the per-stage engine). A plan that accumulates
(GPipe, 1F1B) runs the micro-batch pieces instead (`micro_forward`, `micro_backward`,
`micro_last`, `apply_sum`), whose stash entries live within the tick.

The stage state a call sees is its core unpacked (params, model_state, opt_state, rng,
pushes, pops, stash_batch: see `fdg_jax.schedules`) and its stash a `ring.RingView`.
Traced flags (the pipeline fill) mask a call's effects, bit for bit: a masked stage's state
and messages stay as they were.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from fdg_jax import ring as ring_lib
from fdg_jax import staleness as staleness_lib
from fdg_jax.ring import select as _select
from fdg_jax.shrink import shrink
from fdg_jax.stages import Stage, stage_key, training_vjp

PyTree = Any
NO_UPDATE = -1  # `updated`'s entry where a stage applied no gradient


def classification_metrics(outputs, labels) -> dict:
  """Accuracy of logits `outputs` [B, C] against int labels [B] or one-hot labels [B, C]."""
  pred = jnp.argmax(outputs, axis=-1)
  if labels.ndim == outputs.ndim:
    labels = jnp.argmax(labels, axis=-1)
  return {"accuracy": jnp.mean((pred == labels).astype(jnp.float32))}


def stage_optimizers(optimizer, delays: Sequence[int], beta: float = 1.0,
                     shrink_at: str = "gradient") -> list:
  """Each stage's optimizer: `optimizer` itself, its k-th entry, or `optimizer(k, d_k)`.

  Every one becomes a `staleness.DelayedTransformation` (a plain optax transform gets the
  identity forward hook); FDG's shrinking is chained first (`shrink_at="gradient"`, the
  paper's), or last (`"update"`: a learning-rate scale, for optimisers such as Adam whose
  update ignores a constant gradient scale).
  """
  K = len(delays)
  if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
    opts = [optimizer] * K
  elif callable(optimizer):  # a factory of the stage and its delay
    opts = [optimizer(k, d) for k, d in enumerate(delays)]
  else:
    opts = list(optimizer)
    if len(opts) != K:
      raise ValueError(f"got {len(opts)} optimizers for {K} stages")
  if beta != 1.0 and shrink_at == "gradient":
    opts = [staleness_lib.chain(shrink(beta, k, K), o) for k, o in enumerate(opts)]
  elif beta != 1.0:
    opts = [staleness_lib.chain(o, shrink(beta, k, K)) for k, o in enumerate(opts)]
  return [staleness_lib.with_forward(o) for o in opts]


def _count(flag):
  """1 if `flag` else 0, as int32 (static for a Python bool)."""
  return 1 if flag is True else flag.astype(jnp.int32)


class StageMath:
  """The pure per-stage pieces of a schedule's ticks (see the module docstring).

  `shapes` (a `fdg_jax.shapes.Shapes`) says how a stage's state and stash entries are laid
  out; it is filled in once the batch's shapes are known.
  """

  def __init__(self, plan, stages: Sequence[Stage], loss_fn: Callable, optimizers: list,
               metrics_fn: Callable | None, backward: str, telemetry: bool, shapes):
    self.plan = plan
    self.stages = list(stages)
    self.num_stages = len(self.stages)
    self.loss_fn = loss_fn
    self.optimizers = optimizers
    self.metrics_fn = metrics_fn or classification_metrics
    self.backward_policy = backward
    self.telemetry = telemetry
    self.shapes = shapes
    self.microbatches = plan.microbatches
    # Set while a program over data-parallel replicas is traced (`per_replica`).
    self.data_axis = None
    self._residuals = None

  # ------------------------------------------------------------------ context
  def flags(self, k: int, t):
    """(forwards, backwards) of stage k at tick t (see `plans.Plan.flags`)."""
    return self.plan.flags(k, t)

  def reachable_flags(self, k: int) -> list[tuple[bool, bool]]:
    """The (forwards, backwards) combinations stage k meets over all ticks (the flags are
    constant from the end of the pipeline fill on)."""
    return sorted({self.flags(k, t) for t in range(self.plan.fill_ticks + 1)})

  @contextlib.contextmanager
  def per_replica(self, axis: str, residuals: list):
    """Within: the stage work of one replica of an SPMD program over replicas: keys per
    replica, means over `axis`, and the stash layouts (`residuals`) of a replica's batch."""
    saved = self.data_axis, self._residuals
    self.data_axis, self._residuals = axis, list(residuals)
    try:
      yield
    finally:
      self.data_axis, self._residuals = saved

  def residuals(self, k: int):
    """How stage k's stash entry holds its vjp residuals (`stages.Residuals`)."""
    return (self._residuals or self.shapes.stash_residuals)[k]

  def key(self, stage_rng, batch):
    """`stages.stage_key`, and within a program over replicas, each replica's own key (its
    own dropout masks for its part of the batch)."""
    key = stage_key(stage_rng, batch)
    if self.data_axis is not None:
      key = jax.random.fold_in(key, jax.lax.axis_index(self.data_axis))
    return key

  def replica_mean(self, tree):
    """Within a program over replicas, the mean over them of `tree`'s float leaves
    (gradients, BatchNorm statistics, loss and metrics); else `tree`. The other engines need
    none: their programs see the global batch, and jit inserts the all-reduce."""
    if self.data_axis is None:
      return tree
    mean = lambda a: (jax.lax.pmean(a, self.data_axis)
                      if jnp.issubdtype(a.dtype, jnp.inexact) else a)
    return jax.tree.map(mean, tree)

  # ------------------------------------------------------------------ the pieces
  def forward_params(self, k, params, opt_state, flag):
    """The weights stage k's forward runs at (its optimizer's forward hook, e.g. weight
    prediction), and the optimizer state after the hook; masked by `flag`."""
    new_params, new_state = self.optimizers[k].forward(params, opt_state)
    same = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    if not same(new_state, opt_state):  # a hook that records (DC's ring of forward weights)
      new_state = _select(flag, new_state, opt_state)
    return new_params, new_state

  def vjp(self, k, params, model_state, x, rng):
    """vjp of stage k's training forward (see `fdg_jax.stages.training_vjp`)."""
    return training_vjp(self.stages[k], params, model_state, x, rng)

  def forward(self, k, params, model_state, x, rng):
    """Stage k's training forward. Returns (y, new model state, stash entry)."""
    if self.backward_policy == "stash":
      y, vjp_fn, new_state = self.vjp(k, params, model_state, x, rng)
      # The vjp's residuals but its constants (`Residuals`), known once the shapes are.
      residuals = self.residuals(k)
      entry = tuple(jax.tree.leaves(vjp_fn))
      entry = residuals.stored(entry) if residuals is not None else entry
    else:
      y, new_state = self.stages[k].apply(params, model_state, x, train=True, rng=rng)
      # The input's leaves (a message may be any pytree); the key is rebuilt from the
      # batch index (see `stages.stage_key`).
      entry = tuple(jax.tree.leaves(x))
    return y, new_state, entry

  def backward(self, k, params, model_state, opt_state, entry, cotangent, rng):
    """Gradient w.r.t. stage k's params and input, given the stash entry and a cotangent.

    `rng` is the key the forward used, and `opt_state` the stage's optimizer state (needed
    only to recompute the forward: at the weights its optimizer's backward hook gives,
    e.g. PipeMare's reconstruction, by default the current ones)."""
    entry = entry[:self.shapes.core_entry_sizes[k]]  # without the telemetry's extras
    if self.backward_policy == "stash":
      vjp_fn = self.residuals(k).vjp_fn(entry)
    else:
      x = jax.tree.unflatten(self.shapes.input_treedefs[k], entry)
      params = self.optimizers[k].backward(params, opt_state)
      _, vjp_fn, _ = self.vjp(k, params, model_state, x, rng)
    grad_params, grad_x, _ = vjp_fn(cotangent)
    return grad_params, grad_x

  def update(self, k, params, opt_state, grads):
    grads = self.replica_mean(grads)
    updates, opt_state = self.optimizers[k].update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def telemetry_extras(self, k, params_fwd, x, y) -> tuple:
    """What telemetry adds to stage k's stash entry: the weights its forward ran at and,
    on stage 0, the batch itself (every batch awaiting a gradient is in stage 0's ring)."""
    if not self.telemetry:
      return ()
    return tuple(jax.tree.leaves(params_fwd)) + ((x, y) if k == 0 else ())

  # ------------------------------------------------------------------ a stage's call
  def stage_work(self, k, s, act, cot, do_fwd, do_bwd):
    """Stage k < K-1 at one tick: optional delayed backward and update, then optional forward.

    `s` is the stage state with its core unpacked and its stash a `ring.RingView`. Returns
    (s, activation message (h, y, batch) or None, cotangent for stage k-1 or None, index of
    the batch whose gradient was applied or None). A forward after the update in one call
    runs at the new weights (FDG); BP and DDG call the forward and the backward separately.
    Traced flags mask the updates (a masked `updated` is NO_UPDATE).
    """
    D = self.plan.ring_sizes[k]
    s = dict(s)
    params_fwd = s["params"]
    act_out = cot_out = updated = None
    if do_bwd is not False:
      slot = s["pops"] % D
      entry = s["stash"].read(slot)
      key = self.key(s["rng"], s["stash_batch"][slot])
      grads, grad_x = self.backward(k, s["params"], s["model_state"], s["opt_state"], entry,
                                    cot, key)
      params, opt_state = self.update(k, s["params"], s["opt_state"], grads)
      params, opt_state = _select(do_bwd, (params, opt_state), (s["params"], s["opt_state"]))
      updated = _select(do_bwd, s["stash_batch"][slot], NO_UPDATE)
      s.update(params=params, opt_state=opt_state, pops=s["pops"] + _count(do_bwd))
      if k > 0:
        cot_out = grad_x
      params_fwd = params
    if do_fwd is not False:
      if k == 0:
        (x, y), batch = act, s["pushes"]
      else:
        x, y, batch = act
      params_fwd, s["opt_state"] = self.forward_params(k, params_fwd, s["opt_state"], do_fwd)
      h, model_state, entry = self.forward(k, params_fwd, s["model_state"], x,
                                           self.key(s["rng"], batch))
      entry = entry + self.telemetry_extras(k, params_fwd, x, y)
      slot = s["pushes"] % D
      s["stash"] = s["stash"].write(slot, entry, do_fwd)
      s["stash_batch"] = s["stash_batch"].at[slot].set(
          _select(do_fwd, batch, s["stash_batch"][slot]))
      model_state = _select(do_fwd, self.replica_mean(model_state), s["model_state"])
      s.update(model_state=model_state, pushes=s["pushes"] + _count(do_fwd))
      act_out = (h, y, batch)
    return s, act_out, cot_out, updated

  def stage_with_ring(self, k, s, act, cot, do_fwd, do_bwd, work=None):
    """`stage_work` (or `work`, of the same signature) of stage k around its stash ring
    (`ring.with_ring`): the fused and per-stage engines' stage work."""
    work = self.stage_work if work is None else work
    shapes = self.shapes
    return ring_lib.with_ring(functools.partial(work, k), s, act, cot, do_fwd, do_bwd,
                              size=self.plan.ring_sizes[k], layout=shapes.ring_layouts[k],
                              head=shapes.has_head(k), read=functools.partial(self.ring_load, k),
                              write=functools.partial(self.ring_store, k))

  def ring_load(self, k, ring, slot):
    """The entry at `slot` of stage k's ring (`ring.load`)."""
    return ring_lib.load(self.shapes.ring_layouts[k], ring, slot)

  def ring_store(self, k, ring, slot, entry, flag):
    """Stage k's `ring` with `entry` written at `slot` where `flag` (`ring.store`)."""
    return ring_lib.store(self.shapes.ring_layouts[k], ring, slot, entry, flag)

  def last_work(self, s, act, active):
    """The last stage at one tick: forward, loss, gradient, update.

    Returns (s, cotangent for stage K-2 or None, metrics: loss, batch and `metrics_fn`'s).
    """
    K = self.num_stages
    stage = self.stages[K - 1]
    s = dict(s)
    if K == 1:
      (x, y), batch = act, s["pushes"]
    else:
      x, y, batch = act
    sub = self.key(s["rng"], batch)
    params_fwd, s["opt_state"] = self.forward_params(K - 1, s["params"], s["opt_state"], active)

    def loss(p, a):
      out, ms = stage.apply(p, s["model_state"], a, train=True, rng=sub)
      return self.loss_fn(out, y), (out, ms)

    argnums = (0, 1) if K > 1 else 0
    (value, (out, ms)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(
        params_fwd, x)
    grads, grad_x = grads if K > 1 else (grads, None)
    params, opt_state = self.update(K - 1, s["params"], s["opt_state"], grads)
    new = _select(active, (params, opt_state, self.replica_mean(ms)),
                  (s["params"], s["opt_state"], s["model_state"]))
    s.update(zip(("params", "opt_state", "model_state"), new))
    s["pushes"] = s["pushes"] + _count(active)
    metrics = self.replica_mean({"loss": value, "batch": batch, **self.metrics_fn(out, y)})
    return s, grad_x, metrics

  def call(self, k, s, act, cot, do_fwd, do_bwd):
    """Stage k's call, whichever stage it is: (s, activation out or None, cotangent out or
    None, batch updated or None, metrics ({} but for the last stage)). For the last stage
    the flags are (active, active)."""
    if k == self.num_stages - 1:
      s, cot_out, metrics = self.last_work(s, act, do_fwd)
      return s, None, cot_out, _select(do_fwd, metrics["batch"], NO_UPDATE), metrics
    s, act_out, cot_out, updated = self.stage_work(k, s, act, cot, do_fwd, do_bwd)
    return s, act_out, cot_out, updated, {}

  # ------------------------------------------------------------------ micro-batches
  def micro(self, tree, m):
    """Micro-batch m of a batch-major pytree (the plan's M equal parts)."""
    M = self.microbatches

    def cut(a):
      n = a.shape[0] // M
      return jax.lax.dynamic_slice_in_dim(a, m * n, n, axis=0)
    return jax.tree.map(cut, tree)

  def micro_key(self, s, t, m):
    return jax.random.fold_in(jax.random.fold_in(s["rng"], t), m)

  def micro_forward(self, k, s, x, t, m):
    """Stage k's training forward of micro-batch m, its gradient to be summed: (new model
    state, output, vjp function: the tick's stash entry)."""
    params, _ = self.optimizers[k].forward(s["params"], s["opt_state"])
    y, vjp_fn, ms = training_vjp(self.stages[k], params, s["model_state"], x,
                                 self.micro_key(s, t, m))
    return ms, y, vjp_fn

  def micro_backward(self, k, vjp_fn, cot, acc):
    """A micro-batch's backward on stage k: (the stage's gradient sum with this one added,
    the cotangent of its input, None on stage 0)."""
    g, gx, _ = vjp_fn(cot)
    return (g if acc is None else jax.tree.map(jnp.add, acc, g)), (gx if k > 0 else None)

  def micro_last(self, s, x, y, t, m):
    """The last stage on micro-batch m: (new model state, its gradient, cotangent of x,
    loss, outputs). The loss is the micro-batch mean over M: the M of them sum to the
    batch's."""
    K, M = self.num_stages, self.microbatches
    stage = self.stages[K - 1]
    params, _ = self.optimizers[K - 1].forward(s["params"], s["opt_state"])

    def loss(p, a):
      out, ms = stage.apply(p, s["model_state"], a, train=True, rng=self.micro_key(s, t, m))
      return self.loss_fn(out, y) / M, (out, ms)

    (value, (out, ms)), grads = jax.value_and_grad(loss, (0, 1) if K > 1 else 0,
                                                   has_aux=True)(params, x)
    grads, gx = grads if K > 1 else (grads, None)
    return ms, grads, gx, value, out

  def apply_sum(self, k, s, grads):
    """The update call: stage k applies the gradients it summed over the tick."""
    updates, opt_state = self.optimizers[k].update(grads, s["opt_state"], s["params"])
    return {**s, "params": optax.apply_updates(s["params"], updates), "opt_state": opt_state}

  # ------------------------------------------------------------------ packing
  def unpack_stage(self, k, packed) -> dict:
    """Stage k's state as a call sees it: its core unpacked (a plan that accumulates keeps
    it unpacked), its stash as it is."""
    return self.plan.kind.unpack_stage(self.shapes.core_layouts[k], packed)

  def pack_stage(self, k, s) -> dict:
    """The inverse of `unpack_stage`."""
    return self.plan.kind.pack_stage(self.shapes.core_layouts[k], s)
