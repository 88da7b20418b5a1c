"""The BP, DDG and FDG schedules: one tick of each, exactly as ALGORITHMS.md fixes it.

Design. The network is K stages (`fdg_jax.Stage`). Each stage k has its own state pytree:

    params, model_state, opt_state, rng,
    stash:        the ring buffer of delayed-backward entries, every leaf with a leading axis
                  of length D_k (D_k = 1 for BP, K-k for DDG, 2(K-1-k) for FDG; the last
                  stage has none),
    stash_batch:  int32[D_k], which batch each slot belongs to,
    pushes, pops: int32 counters; the next slot written is pushes % D_k, read pops % D_k.

A stash entry is, under `backward="stash"`, the residuals of `jax.vjp` of the stage's forward
(so the delayed backward is exactly the gradient at the weights that forward used), and under
`backward="recompute"` only the stage input and its RNG key (the backward re-runs the vjp with
the current weights).

A stage's work at a tick is done by a jitted function of (stage state, arriving activation,
arriving cotangent) -> (stage state, activation to send, cotangent to send, batch updated),
with the stage state donated: one call per stage under FDG (backward, then forward), a
forward call and a backward call under BP and DDG (whose forward must leave the stage before
the backward runs). Which of the forward and backward a stage runs at tick t is
known on the host (warm-up), so a stage compiles at most three variants (forward only,
backward only, both) and steady-state ticks never retrace (the state's output shardings are
fixed to its input ones). Messages between stages are moved explicitly by the `Placement`
(`jax.device_put` to the neighbour's devices; in a multi-process run, shard by shard between
each process's own devices); nothing blocks inside a tick and nothing reads a device value.

Messages sent at tick t are read at tick t+1 (DDG cotangents, FDG activations and cotangents);
they are carried in the schedule state's `inbox`, preallocated with zeros so the state has one
fixed structure from the first tick on (and can be checkpointed at any tick).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fdg_jax.placement import Placement
from fdg_jax.shrink import shrink
from fdg_jax.delays import delay, ring_size
from fdg_jax.stages import Stage, training_vjp

PyTree = Any
ALGORITHMS = ("bp", "ddg", "fdg")
BACKWARD_POLICIES = ("stash", "recompute")


def classification_metrics(outputs, labels) -> dict:
  """Accuracy of logits `outputs` [B, C] against int labels [B] or one-hot labels [B, C]."""
  pred = jnp.argmax(outputs, axis=-1)
  if labels.ndim == outputs.ndim:
    labels = jnp.argmax(labels, axis=-1)
  return {"accuracy": jnp.mean((pred == labels).astype(jnp.float32))}


class Schedule:
  """A decoupled-training schedule over K stages. Build with `bp`, `ddg` or `fdg`.

  Public methods: `init`, `step`, `params`, `model_states`, `evaluate`. The state is a pytree
  of device arrays plus a host integer `tick`; `step` consumes (donates) the state it is
  given, so always continue from the state it returns.
  """

  def __init__(self, algorithm: str, stages: Sequence[Stage], loss_fn: Callable,
               optimizer, *, beta: float = 1.0, backward: str = "stash",
               devices=None, mesh=None, metrics_fn: Callable | None = None):
    if algorithm not in ALGORITHMS:
      raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if backward not in BACKWARD_POLICIES:
      raise ValueError(f"unknown backward policy {backward!r}; choose one of {BACKWARD_POLICIES}")
    stages = list(stages)
    if not stages:
      raise ValueError("a schedule needs at least one stage")
    if not all(isinstance(s, Stage) for s in stages):
      raise TypeError("stages must be fdg_jax.Stage objects (see Stage.from_fn / from_linen)")
    if not 0.0 < beta <= 1.0:
      raise ValueError(f"beta must lie in (0, 1], got {beta}")
    if algorithm != "fdg" and beta != 1.0:
      raise ValueError(f"beta (gradient shrinking) is an FDG option; {algorithm} takes none")
    self.algorithm = algorithm
    self.stages = stages
    self.num_stages = len(stages)
    self.loss_fn = loss_fn
    self.beta = float(beta)
    self.backward = backward
    self.metrics_fn = metrics_fn or classification_metrics
    self.placement = Placement.create(self.num_stages, devices=devices, mesh=mesh)
    self.optimizers = self._stage_optimizers(optimizer)
    self._stash_treedefs: list = [None] * self.num_stages
    self._batch_spec = None
    self._step_fns: dict = {}
    self._eval_fns: dict = {}

  # ------------------------------------------------------------------ properties
  @property
  def delays(self) -> tuple[int, ...]:
    """d_k for every stage: the staleness of the gradient stage k applies."""
    return tuple(delay(self.algorithm, k, self.num_stages) for k in range(self.num_stages))

  @property
  def ring_sizes(self) -> tuple[int, ...]:
    """D_k for every stage: the number of stash slots it carries."""
    return tuple(ring_size(self.algorithm, k, self.num_stages) for k in range(self.num_stages))

  def _stage_optimizers(self, optimizer):
    K = self.num_stages
    if isinstance(optimizer, optax.GradientTransformation):
      opts = [optimizer] * K
    else:
      opts = list(optimizer)
      if len(opts) != K:
        raise ValueError(f"got {len(opts)} optimizers for {K} stages")
    if self.algorithm == "fdg" and self.beta != 1.0:
      opts = [optax.chain(shrink(self.beta, k, K), o) for k, o in enumerate(opts)]
    return opts

  # ------------------------------------------------------------------ pure pieces
  def _vjp(self, k, params, model_state, x, rng):
    """vjp of stage k's training forward (see `fdg_jax.stages.training_vjp`)."""
    return training_vjp(self.stages[k], params, model_state, x, rng)

  def _forward(self, k, params, model_state, x, rng):
    """Stage k's training forward. Returns (y, new model state, stash entry)."""
    if self.backward == "stash":
      y, vjp_fn, new_state = self._vjp(k, params, model_state, x, rng)
      entry = tuple(jax.tree.leaves(vjp_fn))
    else:
      y, new_state = self.stages[k].apply(params, model_state, x, train=True, rng=rng)
      entry = (x, rng)
    return y, new_state, entry

  def _backward(self, k, params, model_state, entry, cotangent):
    """Gradient w.r.t. stage k's params and input, given the stash entry and a cotangent."""
    if self.backward == "stash":
      vjp_fn = jax.tree.unflatten(self._stash_treedefs[k], list(entry))
    else:
      x, rng = entry
      _, vjp_fn, _ = self._vjp(k, params, model_state, x, rng)
    grad_params, grad_x, _ = vjp_fn(cotangent)
    return grad_params, grad_x

  def _update(self, k, params, opt_state, grads):
    updates, opt_state = self.optimizers[k].update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  # ------------------------------------------------------------------ jitted stage steps
  def _stage_fn(self, k: int, do_forward: bool, do_backward: bool):
    """Jitted work of stage k < K-1 at one tick: optional backward, then optional forward.

    Signature: (stage_state, activation_msg, cotangent) ->
               (stage_state, activation_msg_out, cotangent_out, batch_updated).
    Under FDG the forward uses the parameters just updated by the backward. DDG and BP call
    the forward and the backward separately (forward first, with the parameters at the
    start of the tick).
    """
    key = (k, do_forward, do_backward)
    if key in self._step_fns:
      return self._step_fns[key]
    D = ring_size(self.algorithm, k, self.num_stages)
    forward_after_update = self.algorithm == "fdg"

    def step(s, act, cot):
      s = dict(s)
      params_fwd = s["params"]
      act_out = cot_out = updated = None
      if do_backward:
        slot = s["pops"] % D
        entry = jax.tree.map(lambda buf: buf[slot], s["stash"])
        updated = s["stash_batch"][slot]
        grads, grad_x = self._backward(k, s["params"], s["model_state"], entry, cot)
        params, opt_state = self._update(k, s["params"], s["opt_state"], grads)
        s.update(params=params, opt_state=opt_state, pops=s["pops"] + 1)
        if k > 0:
          cot_out = grad_x
        if forward_after_update:
          params_fwd = params
      if do_forward:
        if k == 0:
          (x, y), batch = act, s["pushes"]
        else:
          x, y, batch = act
        rng, sub = jax.random.split(s["rng"])
        h, model_state, entry = self._forward(k, params_fwd, s["model_state"], x, sub)
        slot = s["pushes"] % D
        s["stash"] = jax.tree.map(lambda buf, e: buf.at[slot].set(e), s["stash"], entry)
        s["stash_batch"] = s["stash_batch"].at[slot].set(batch)
        s.update(model_state=model_state, rng=rng, pushes=s["pushes"] + 1)
        act_out = (h, y, batch)
      return s, act_out, cot_out, updated

    # Fixed output shardings: the state comes back exactly as it went in (so the next tick
    # hits the same compiled variant, also under a mesh, where propagation would otherwise
    # pick the stash's sharding), and messages leave sharded like the batch.
    P = self.placement
    out_shardings = (self._state_shardings(k),
                     self._act_shardings[k] if do_forward else None,
                     self._cot_shardings[k] if do_backward and k > 0 else None,
                     P.scalar_shardings[k] if do_backward else None)
    fn = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
    self._step_fns[key] = fn
    return fn

  def _last_fn(self):
    """Jitted work of the last stage: forward, loss, gradient, update.

    Signature: (stage_state, activation_msg) -> (stage_state, cotangent_out, metrics).
    """
    key = ("last",)
    if key in self._step_fns:
      return self._step_fns[key]
    K = self.num_stages
    stage = self.stages[K - 1]

    def step(s, act):
      s = dict(s)
      if K == 1:
        (x, y), batch = act, s["pushes"]
      else:
        x, y, batch = act
      rng, sub = jax.random.split(s["rng"])

      def loss(p, a):
        out, ms = stage.apply(p, s["model_state"], a, train=True, rng=sub)
        return self.loss_fn(out, y), (out, ms)

      argnums = (0, 1) if K > 1 else 0
      (value, (out, ms)), grads = jax.value_and_grad(loss, argnums, has_aux=True)(
          s["params"], x)
      grads, grad_x = grads if K > 1 else (grads, None)
      params, opt_state = self._update(K - 1, s["params"], s["opt_state"], grads)
      s.update(params=params, opt_state=opt_state, model_state=ms, rng=rng,
               pushes=s["pushes"] + 1)
      metrics = {"loss": value, "batch": batch, **self.metrics_fn(out, y)}
      return s, grad_x, metrics

    P = self.placement
    out_shardings = (self._state_shardings(K - 1),
                     self._cot_shardings[K - 1] if K > 1 else None,
                     P.scalar_shardings[K - 1])
    fn = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
    self._step_fns[key] = fn
    return fn

  # ------------------------------------------------------------------ init / allocation
  def init(self, params: Sequence[PyTree], model_state: Sequence[PyTree] | None = None, *,
           rng: jax.Array | None = None, example_batch=None) -> dict:
    """The schedule state at tick 0.

    Args:
      params: K per-stage parameter pytrees (copied onto each stage's devices).
      model_state: K per-stage model states (e.g. BatchNorm statistics), or None (all `{}`).
      rng: PRNG key for stochastic layers (default `PRNGKey(0)`).
      example_batch: an `(x, y)` batch of the training shape; allocates the stash and the
        message buffers now. Without it they are allocated at the first `step`.
    """
    K = self.num_stages
    params = list(params)
    if len(params) != K:
      raise ValueError(f"got {len(params)} parameter pytrees for {K} stages")
    model_state = [{}] * K if model_state is None else list(model_state)
    if len(model_state) != K:
      raise ValueError(f"got {len(model_state)} model states for {K} stages")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    stages = []
    for k in range(K):
      s = {
          "params": params[k],
          "model_state": model_state[k],
          "opt_state": self.optimizers[k].init(params[k]),
          "rng": jax.random.fold_in(rng, k),
          "pushes": jnp.zeros((), jnp.int32),
          "pops": jnp.zeros((), jnp.int32),
      }
      stages.append(self.placement.put_state(k, s))
    state = {"tick": np.asarray(0, np.int64), "stages": stages, "inbox": None}
    if example_batch is not None:
      state = self._allocate(state, self.placement.put_batch(0, tuple(example_batch)))
    return state

  def _prepare(self, state, batch):
    """Shapes and shardings of the stash entries and messages, for `batch`'s shapes.

    `batch` is the global batch (already placed on stage 0). A stash leaf is batch-major
    along the axis whose size follows the batch size (found by tracing the stage at the
    batch size and at twice it); such leaves are sharded along that axis under a mesh.
    """
    K, P = self.num_stages, self.placement
    spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), t)
    doubled = lambda t: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((2 * a.shape[0],) + a.shape[1:], a.dtype)
        if a.shape else a, t)
    x_spec, y_spec = spec(batch[0]), spec(batch[1])
    self._batch_spec = (x_spec, y_spec)
    self._entry_specs, self._stash_shardings = [None] * K, [None] * K
    self._act_specs, self._act_shardings, self._cot_shardings = ([None] * K for _ in range(3))
    stages = state["stages"]

    def entry_and_output(k, a):
      s = stages[k]
      if self.backward == "stash":
        _, vjp_spec, _ = jax.eval_shape(
            lambda p, ms, a, r: self._vjp(k, p, ms, a, r),
            s["params"], s["model_state"], a, s["rng"])
        leaves, treedef = jax.tree.flatten(vjp_spec)
        entry = tuple(leaves)
      else:
        entry, treedef = (a, spec(s["rng"])), None
      h, _, _ = jax.eval_shape(
          lambda p, ms, a, r: self._forward(k, p, ms, a, r),
          s["params"], s["model_state"], a, s["rng"])
      return entry, treedef, h

    a_spec, a_spec2 = x_spec, doubled(x_spec)
    for k in range(K):
      self._cot_shardings[k] = P.message_shardings(k, a_spec)
      if k == K - 1:
        break
      entry, self._stash_treedefs[k], h_spec = entry_and_output(k, a_spec)
      entry2, _, h_spec2 = entry_and_output(k, a_spec2)

      def buffer_sharding(e, e2, k=k):
        axis = next((i for i, (m, n) in enumerate(zip(e.shape, e2.shape)) if m != n), None)
        if axis is not None and e.shape[axis] % P.num_replicas:
          axis = None  # cannot be split evenly over the replicas: keep it replicated
        return P.buffer_sharding(k, None if axis is None else axis + 1)  # +1: ring axis

      self._entry_specs[k] = entry
      self._act_specs[k] = (h_spec, y_spec, jax.ShapeDtypeStruct((), jnp.int32))
      self._stash_shardings[k] = jax.tree.map(buffer_sharding, entry, entry2)
      self._act_shardings[k] = P.message_shardings(k, self._act_specs[k])
      a_spec, a_spec2 = h_spec, h_spec2

  def _state_shardings(self, k: int) -> dict:
    """The sharding of every entry of stage k's state (a prefix of its pytree)."""
    rep = self.placement.state_shardings[k]
    out = {name: rep for name in ("params", "model_state", "opt_state", "rng", "pushes",
                                  "pops")}
    if k < self.num_stages - 1:
      out.update(stash=self._stash_shardings[k], stash_batch=rep)
    return out

  def _allocate(self, state, batch):
    """Adds zero-filled stash and message buffers sized for `batch` (global, on stage 0)."""
    K, P = self.num_stages, self.placement
    self._prepare(state, batch)
    stages, inbox = list(state["stages"]), [dict() for _ in range(K)]
    for k in range(K - 1):
      s = dict(stages[k])
      D = ring_size(self.algorithm, k, K)
      s["stash"] = _zeros(jax.tree.map(lambda e: jax.ShapeDtypeStruct((D,) + e.shape, e.dtype),
                                       self._entry_specs[k]), self._stash_shardings[k])
      s["stash_batch"] = _zeros(jax.ShapeDtypeStruct((D,), jnp.int32), P.state_shardings[k])
      stages[k] = s
      # Placeholders for stage k's incoming cotangent and stage k+1's incoming activation,
      # where (and shaped as) the real messages will arrive.
      act_spec = self._act_specs[k]
      if self.algorithm in ("ddg", "fdg"):
        inbox[k]["cot"] = _zeros(act_spec[0], P.message_shardings(k, act_spec[0]))
      if self.algorithm == "fdg":
        inbox[k + 1]["act"] = _zeros(act_spec, P.message_shardings(k + 1, act_spec))
    return {**state, "stages": stages, "inbox": inbox}

  # ------------------------------------------------------------------ one tick
  def step(self, state: dict, batch) -> tuple[dict, dict]:
    """Runs one tick: batch b_t = (x_t, y_t) enters the pipeline.

    Returns:
      (state, metrics). metrics has `tick`, `updated` (per stage: the index of the batch
      whose gradient the stage applied this tick, as a device scalar, or None if it did not
      update), and, once a batch reaches the loss, `loss`, `batch` (its index) and the
      `metrics_fn` values (default `accuracy`) of that batch.
    """
    K, P, delays = self.num_stages, self.placement, self.delays
    # In a multi-process run `batch` is this process's slice; batch_msg is the global batch.
    batch_msg = P.put_batch(0, tuple(batch))
    if state["inbox"] is None:
      state = self._allocate(state, batch_msg)
    elif self._batch_spec is None:  # a state restored into a fresh schedule
      self._prepare(state, batch_msg)
    t = int(state["tick"])
    stages = list(state["stages"])
    inbox = state["inbox"]
    new_inbox = [dict(box) for box in inbox]  # unsent messages keep their placeholders
    updated: list = [None] * K
    metrics: dict = {}

    def run_last(act):
      stages[K - 1], cot, m = self._last_fn()(stages[K - 1], act)
      updated[K - 1] = m["batch"]
      metrics.update(m)
      return cot

    if self.algorithm == "fdg":
      # Every message of an FDG tick is read at the next one, so all are moved at the end in
      # one batched device_put: its host cost per call dominates the dispatch of small stages.
      outgoing = []  # (receiving stage, "act" | "cot", message)
      for k in range(K - 1):
        # Stage k forwards batch t-k; its first cotangent arrives d_k ticks after its first forward.
        do_fwd, do_bwd = t >= k, t >= k + delays[k]
        if not (do_fwd or do_bwd):
          continue
        act = batch_msg if k == 0 else inbox[k]["act"]
        stages[k], act_out, cot_out, updated[k] = self._stage_fn(k, do_fwd, do_bwd)(
            stages[k], act if do_fwd else None, inbox[k]["cot"] if do_bwd else None)
        if act_out is not None:
          outgoing.append((k + 1, "act", act_out))
        if cot_out is not None:
          outgoing.append((k - 1, "cot", cot_out))
      if t >= K - 1:
        cot = run_last(batch_msg if K == 1 else inbox[K - 1]["act"])
        if cot is not None:
          outgoing.append((K - 2, "cot", cot))
      moved = P.put_batches([(k, m) for k, _, m in outgoing])
      for (k, kind, _), m in zip(outgoing, moved):
        new_inbox[k][kind] = m

    elif self.algorithm == "ddg":
      # The forward of b_t runs through every stage within the tick, so each stage's forward
      # is its own call: its activation can leave as soon as it is computed, while the
      # stage's delayed backward (a separate call, dispatched after all forwards) runs
      # concurrently with the forwards of the stages above it.
      act = batch_msg
      for k in range(K - 1):
        stages[k], act_out, _, _ = self._stage_fn(k, True, False)(stages[k], act, None)
        act = P.put_batch(k + 1, act_out)
      cot = run_last(act)
      if cot is not None:
        new_inbox[K - 2]["cot"] = P.put_batch(K - 2, cot)
      for k in reversed(range(K - 1)):
        if t >= delays[k]:  # stage k+1 sent a cotangent at tick t-1
          stages[k], _, cot_out, updated[k] = self._stage_fn(k, False, True)(
              stages[k], None, inbox[k]["cot"])
          if cot_out is not None:
            new_inbox[k - 1]["cot"] = P.put_batch(k - 1, cot_out)

    else:  # bp: the whole forward and backward of b_t within the tick
      act = batch_msg
      for k in range(K - 1):
        stages[k], act_out, _, _ = self._stage_fn(k, True, False)(stages[k], act, None)
        act = P.put_batch(k + 1, act_out)
      cot = run_last(act)
      for k in reversed(range(K - 1)):
        stages[k], _, cot, updated[k] = self._stage_fn(k, False, True)(
            stages[k], None, P.put_batch(k, cot))

    metrics["tick"] = t
    metrics["updated"] = tuple(updated)
    new_state = {"tick": np.asarray(t + 1, np.int64), "stages": stages, "inbox": new_inbox}
    return new_state, metrics

  # ------------------------------------------------------------------ accessors
  def params(self, state) -> list:
    """The K per-stage parameter pytrees."""
    return [s["params"] for s in state["stages"]]

  def model_states(self, state) -> list:
    """The K per-stage model states (e.g. BatchNorm running statistics)."""
    return [s["model_state"] for s in state["stages"]]

  def evaluate(self, state, x):
    """Synchronous eval-mode forward of `x` through all stages with the current parameters.

    Returns the last stage's output (on the last stage's devices).
    """
    x = self.placement.put_batch(0, x)
    for k, s in enumerate(state["stages"]):
      if k not in self._eval_fns:
        apply = self.stages[k].apply
        self._eval_fns[k] = jax.jit(lambda p, ms, a, apply=apply: apply(p, ms, a, train=False)[0])
      x = self._eval_fns[k](s["params"], s["model_state"], x)
      if k + 1 < self.num_stages:
        x = self.placement.put_batch(k + 1, x)
    return x

  def stash_bytes(self, state) -> list[int]:
    """Bytes held by each stage's delay buffer (stash and its batch indices)."""
    out = []
    for s in state["stages"]:
      leaves = jax.tree.leaves((s.get("stash", ()), s.get("stash_batch", ())))
      out.append(int(sum(a.size * a.dtype.itemsize for a in leaves)))
    return out


def _zeros(spec, sharding):
  """Zero arrays of the given ShapeDtypeStruct pytree, created directly on `sharding`.

  `sharding` is one sharding for every leaf or a pytree of them matching `spec`.
  """
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=sharding), spec)
  return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), spec, sharding)


def bp(stages, loss_fn, optimizer, *, devices=None, mesh=None, metrics_fn=None) -> Schedule:
  """Backpropagation over K stages: every tick, forward, loss and backward of b_t."""
  return Schedule("bp", stages, loss_fn, optimizer, devices=devices, mesh=mesh,
                  metrics_fn=metrics_fn)


def ddg(stages, loss_fn, optimizer, *, backward="stash", devices=None, mesh=None,
        metrics_fn=None) -> Schedule:
  """Decoupled parallel backprop (Huo et al. 2018): backward unlocked, delay K-1-k."""
  return Schedule("ddg", stages, loss_fn, optimizer, backward=backward, devices=devices,
                  mesh=mesh, metrics_fn=metrics_fn)


def fdg(stages, loss_fn, optimizer, *, beta=1.0, backward="stash", devices=None, mesh=None,
        metrics_fn=None) -> Schedule:
  """Fully decoupled training (Zhuang et al. 2021): all locks broken, delay 2(K-1-k).

  `beta` in (0, 1] shrinks stage k's gradient by beta**(K-1-k) (see `fdg_jax.shrink`).
  """
  return Schedule("fdg", stages, loss_fn, optimizer, beta=beta, backward=backward,
                  devices=devices, mesh=mesh, metrics_fn=metrics_fn)


def create(algorithm: str, stages, loss_fn, optimizer, **kwargs) -> Schedule:
  """`bp`, `ddg` or `fdg` by name (`beta` is accepted only by fdg)."""
  return Schedule(algorithm, stages, loss_fn, optimizer, **kwargs)
