"""GPipe and 1F1B: synchronous pipelines over K stages, run from micro-batch plans.

Each tick's batch b_t (B examples) is split into M contiguous micro-batches of B/M. Every
stage runs the forwards and backwards of its micro-batches in its plan's order
(`plans.microbatch_order`: GPipe all forwards then all backwards, 1F1B one forward one
backward after min(M, K-1-k) warm-up forwards), accumulates its gradients, and updates once
at the end of the tick. The loss is the mean over the whole batch (the mean of the M
micro-batch means), so after every tick the parameters are BP's on b_t up to float reduction
order; there is no delay and no state carried between ticks but parameters, optimizer and
model states. BatchNorm sees each micro-batch alone (its statistics are the micro-batch's,
updated M times per tick), so with BatchNorm the result is BP's on micro-batches.

Engines (the same numbers, tested against BP at K = 1):

- fused (every stage on one device): one program per tick, every micro-batch action traced
  in the plan's global order; the vjp residuals stay inside the program;
- per-stage (a device per stage): each action is a jitted call on its stage's device, issued
  in an order that respects every device's own plan order and every dependency
  (`plans.global_order`), so that with asynchronous dispatch the K devices overlap as the
  schedule intends; an F call returns its vjp residuals, which the stage holds until its B
  call (at most `peak_stash` micro-batches at once: M for GPipe, min(M, K-k) for 1F1B).

SPMD programs and data-parallel meshes are not offered for these plans (refused in one line).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fdg_jax import plans as plans_lib
from fdg_jax import staleness as staleness_lib
from fdg_jax.placement import Placement
from fdg_jax.stages import Stage, training_vjp

SYNC_PLANS = plans_lib.names(microbatched=True)  # the built-in ones (gpipe, 1f1b)


def _classification_metrics(outputs, labels) -> dict:
  pred = jnp.argmax(outputs, axis=-1)
  if labels.ndim == outputs.ndim:
    labels = jnp.argmax(labels, axis=-1)
  return {"accuracy": jnp.mean((pred == labels).astype(jnp.float32))}


class SyncPipeline:
  """A synchronous pipeline (GPipe or 1F1B) with the `Schedule` interface: `init`, `step`,
  `run`, `params`, `model_states`, `stage_state`, `evaluate`, `delays`, `placement`."""

  def __init__(self, name: str, stages: Sequence[Stage], loss_fn: Callable, optimizer, *,
               microbatches: int, devices=None, mesh=None, metrics_fn: Callable | None = None,
               engine: str = "auto", **unused):
    if name not in plans_lib.names(microbatched=True):
      raise ValueError(f"unknown synchronous pipeline {name!r}; choose one of "
                       f"{plans_lib.names(microbatched=True)}")
    bad = sorted(k for k, v in unused.items()
                 if not (k == "backward" and v == "stash") and not (k == "beta" and v == 1.0)
                 and not (k in ("telemetry",) and not v) and v is not None)
    if bad:
      raise ValueError(f"{name} takes no {', '.join(bad)} (it has no delay: no stash policy, "
                       "shrinking or telemetry)")
    if mesh is not None:
      raise ValueError(f"{name} runs on one device or a device per stage; data-parallel "
                       "meshes are for bp, ddg and fdg")
    if engine not in ("auto", "fused", "per_stage"):
      raise ValueError(f"{name} runs on the fused or per-stage engine, not {engine!r}")
    if int(microbatches) < 1:
      raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    self.algorithm = name
    self.stages = list(stages)
    self.num_stages = K = len(self.stages)
    self.microbatches = M = int(microbatches)
    self.loss_fn = loss_fn
    self.metrics_fn = metrics_fn or _classification_metrics
    self.orders = plans_lib.microbatch_order(name, K, M)
    self.order = plans_lib.global_order(self.orders)
    self.peak_stash = tuple(plans_lib.peak_stash(o) for o in self.orders)
    self.placement = Placement.create(K, devices=devices)
    one = self.placement.single_device is not None
    if engine == "fused" and not one:
      raise ValueError("engine='fused' runs every stage on one device; pass devices=None")
    self.engine = ("fused" if one else "per_stage") if engine == "auto" else engine
    if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
      opts = [optimizer] * K
    elif callable(optimizer):  # a factory of the stage and its delay (0)
      opts = [optimizer(k, 0) for k in range(K)]
    else:
      opts = list(optimizer)
    if len(opts) != K:
      raise ValueError(f"got {len(opts)} optimizers for {K} stages")
    self.optimizers = [staleness_lib.with_forward(o) for o in opts]
    self._fns: dict = {}

  # ------------------------------------------------------------------ properties
  @property
  def delays(self) -> tuple[int, ...]:
    return (0,) * self.num_stages

  @property
  def ring_sizes(self) -> tuple[int, ...]:
    """Micro-batches of vjp residuals each stage holds at its peak (no ring: no delay)."""
    return self.peak_stash

  fill_ticks = 0

  # ------------------------------------------------------------------ state
  def init(self, params, model_state=None, *, rng=None, example_batch=None) -> dict:
    del example_batch
    K = self.num_stages
    params = list(params)
    model_state = [{}] * K if model_state is None else list(model_state)
    if len(params) != K or len(model_state) != K:
      raise ValueError(f"need {K} parameter pytrees and model states, got {len(params)}, "
                       f"{len(model_state)}")
    rng = jax.random.PRNGKey(0) if rng is None else rng
    stages = [self.placement.put_state(k, {
        "params": params[k], "model_state": model_state[k],
        "opt_state": self.optimizers[k].init(params[k]), "rng": jax.random.fold_in(rng, k)})
        for k in range(K)]
    return {"tick": np.asarray(0, np.int64), "stages": stages}

  def stage_state(self, state, k: int) -> dict:
    return state["stages"][k]

  def params(self, state) -> list:
    return [s["params"] for s in state["stages"]]

  def model_states(self, state) -> list:
    return [s["model_state"] for s in state["stages"]]

  # ------------------------------------------------------------------ pure pieces
  def _micro(self, tree, m):
    """Micro-batch m of a batch-major pytree."""
    M = self.microbatches

    def cut(a):
      n = a.shape[0] // M
      return jax.lax.dynamic_slice_in_dim(a, m * n, n, axis=0)
    return jax.tree.map(cut, tree)

  def _check_batch(self, x):
    B = int(np.shape(jax.tree.leaves(x)[0])[0])
    if B % self.microbatches:
      raise ValueError(f"a batch of {B} does not split into microbatches={self.microbatches} "
                       f"equal parts; use a batch size that {self.microbatches} divides")

  def _key(self, s, t, m):
    return jax.random.fold_in(jax.random.fold_in(s["rng"], t), m)

  def _forward(self, k, s, x, t, m):
    """Stage k's training forward of micro-batch m: (y, new model state, vjp_fn)."""
    params, _ = self.optimizers[k].forward(s["params"], s["opt_state"])
    y, vjp_fn, ms = training_vjp(self.stages[k], params, s["model_state"], x,
                                 self._key(s, t, m))
    return y, ms, vjp_fn

  def _last(self, s, x, y, t, m):
    """The last stage on micro-batch m: (new model state, its grads, cotangent of x, loss,
    outputs). The loss is the micro-batch mean over M: the M of them sum to the batch's."""
    K, M = self.num_stages, self.microbatches
    stage = self.stages[K - 1]
    params, _ = self.optimizers[K - 1].forward(s["params"], s["opt_state"])

    def loss(p, a):
      out, ms = stage.apply(p, s["model_state"], a, train=True, rng=self._key(s, t, m))
      return self.loss_fn(out, y) / M, (out, ms)

    (value, (out, ms)), grads = jax.value_and_grad(loss, (0, 1) if K > 1 else 0,
                                                   has_aux=True)(params, x)
    grads, gx = grads if K > 1 else (grads, None)
    return ms, grads, gx, value, out

  def _update(self, k, s, grads):
    updates, opt_state = self.optimizers[k].update(grads, s["opt_state"], s["params"])
    return {**s, "params": optax.apply_updates(s["params"], updates), "opt_state": opt_state}

  # ------------------------------------------------------------------ the fused engine
  def _fused_tick(self, stages, batch, t):
    """Every micro-batch action of one tick, in the plan's global order, then the updates."""
    K = self.num_stages
    x, y = batch
    stages = list(stages)
    acts = {(0, m): self._micro(x, m) for m in range(self.microbatches)}
    vjps, cots, grads = {}, {}, [None] * K
    outs, losses = {}, []
    add = lambda a, b: b if a is None else jax.tree.map(jnp.add, a, b)
    for k, kind, m in self.order:
      s = stages[k]
      if kind == "F":
        if k == K - 1:
          ms, g, gx, loss, out = self._last(s, acts[(k, m)], self._micro(y, m), t, m)
          stages[k] = {**s, "model_state": ms}
          cots[(k - 1, m)] = gx
          grads[k] = add(grads[k], g)
          losses.append(loss)
          outs[m] = out
        else:
          h, ms, vjp_fn = self._forward(k, s, acts[(k, m)], t, m)
          stages[k] = {**s, "model_state": ms}
          acts[(k + 1, m)] = h
          vjps[(k, m)] = vjp_fn
      elif k < K - 1:
        g, gx, _ = vjps.pop((k, m))(cots.pop((k, m)))
        grads[k] = add(grads[k], g)
        if k > 0:
          cots[(k - 1, m)] = gx
    stages = [self._update(k, stages[k], grads[k]) for k in range(K)]
    out = jnp.concatenate([outs[m] for m in range(self.microbatches)])
    metrics = {"loss": sum(losses), **self.metrics_fn(out, y)}
    return stages, metrics

  # ------------------------------------------------------------------ the per-stage engine
  def _fn(self, key, make):
    if key not in self._fns:
      self._fns[key] = make()
    return self._fns[key]

  def _forward_fn(self, k):
    def f(s, x, t, m):
      h, ms, vjp_fn = self._forward(k, s, x, t, m)
      return h, ms, vjp_fn
    return self._fn(("F", k), lambda: jax.jit(f))

  def _last_fn(self):
    return self._fn(("L",), lambda: jax.jit(self._last))

  def _backward_fn(self, k):
    def b(vjp_fn, cot, acc):
      g, gx, _ = vjp_fn(cot)
      acc = g if acc is None else jax.tree.map(jnp.add, acc, g)
      return acc, (gx if k > 0 else None)
    return self._fn(("B", k), lambda: jax.jit(b))

  def _update_fn(self, k):
    return self._fn(("U", k), lambda: jax.jit(lambda s, g: self._update(k, s, g),
                                              donate_argnums=0))

  def _per_stage_tick(self, stages, batch, t):
    K, P = self.num_stages, self.placement
    x, y = batch
    stages = list(stages)
    tick = np.int32(t)
    acts = {(0, m): self._micro(x, m) for m in range(self.microbatches)}
    labels = P.put_batch(K - 1, y)
    vjps, cots, grads, outs, losses = {}, {}, [None] * K, {}, []
    for k, kind, m in self.order:
      mm = np.int32(m)
      if kind == "F":
        if k == K - 1:
          ms, g, gx, loss, out = self._last_fn()(stages[k], acts.pop((k, m)),
                                                 self._micro(labels, m), tick, mm)
          stages[k] = {**stages[k], "model_state": ms}
          grads[k] = g if grads[k] is None else jax.tree.map(jnp.add, grads[k], g)
          if K > 1:
            cots[(k - 1, m)] = P.put_batch(k - 1, gx)
          losses.append(loss)
          outs[m] = out
        else:
          h, ms, vjp_fn = self._forward_fn(k)(stages[k], acts.pop((k, m)), tick, mm)
          stages[k] = {**stages[k], "model_state": ms}
          acts[(k + 1, m)] = P.put_batch(k + 1, h)
          vjps[(k, m)] = vjp_fn
      elif k < K - 1:
        grads[k], gx = self._backward_fn(k)(vjps.pop((k, m)), cots.pop((k, m)), grads[k])
        if k > 0:
          cots[(k - 1, m)] = P.put_batch(k - 1, gx)
    stages = [self._update_fn(k)(stages[k], grads[k]) for k in range(K)]
    out = jnp.concatenate([outs[m] for m in range(self.microbatches)])
    metrics = {"loss": sum(losses), **self.metrics_fn(out, labels)}
    return stages, metrics

  # ------------------------------------------------------------------ step / run
  def _tick_fn(self):
    if self.engine == "fused":
      return self._fn(("tick",), lambda: jax.jit(self._fused_tick, donate_argnums=0))
    return self._per_stage_tick

  def step(self, state: dict, batch) -> tuple[dict, dict]:
    """One tick: every micro-batch of `batch` through the pipeline, one update per stage."""
    self._check_batch(batch[0])
    t = int(state["tick"])
    placed = self.placement.put_batch(0, tuple(batch))
    stages, metrics = self._tick_fn()(state["stages"], placed, np.int32(t))
    K = self.num_stages
    metrics = {**metrics, "batch": t, "tick": t, "updated": (t,) * K}
    return {"tick": np.asarray(t + 1, np.int64), "stages": stages}, metrics

  def run(self, state: dict, batches, num_ticks: int | None = None) -> tuple[dict, dict]:
    """T ticks, `batches = (xs, ys)` with a leading ticks axis (as `Schedule.run`)."""
    xs, ys = batches
    length = int(np.shape(jax.tree.leaves(xs)[0])[0])
    T = length if num_ticks is None else int(num_ticks)
    if not 1 <= T <= length:
      raise ValueError(f"run needs 1 <= num_ticks <= {length} (the batches given), got {T}")
    t0, K = int(state["tick"]), self.num_stages
    rows = []
    for i in range(T):
      state, m = self.step(state, (xs[i], ys[i]))
      rows.append(m)
    names = [n for n in rows[0] if n not in ("batch", "tick", "updated")]
    out = {n: np.zeros((length,), np.float32) for n in names}
    for n in names:
      out[n][:T] = np.asarray(jax.device_get([r[n] for r in rows]), np.float32)
    out["batch"] = np.full((length,), -1, np.int32)
    out["batch"][:T] = np.arange(t0, t0 + T)
    out["updated"] = np.full((length, K), -1, np.int32)
    out["updated"][:T] = out["batch"][:T, None]
    out["valid"] = np.arange(length) < T
    out["tick"] = np.where(out["valid"], np.arange(t0, t0 + length), -1)
    return state, out

  def evaluate(self, state, x):
    """A synchronous eval-mode forward through every stage."""
    for k in range(self.num_stages):
      s = state["stages"][k]
      x = self.placement.put_batch(k, x)
      fn = self._fn(("eval", k), lambda k=k: jax.jit(
          lambda p, ms, a: self.stages[k].apply(p, ms, a, train=False)[0]))
      x = fn(s["params"], s["model_state"], x)
    return x

  def telemetry(self, state) -> dict:
    raise ValueError(f"{self.algorithm} has no delay: there is no staleness to measure")


def gpipe(stages, loss_fn, optimizer, *, microbatches: int, **kwargs) -> SyncPipeline:
  """GPipe (Huang et al. 2019): all M micro-batch forwards, then all backwards; one update
  per stage per tick, BP's update (see the module docstring)."""
  return SyncPipeline("gpipe", stages, loss_fn, optimizer, microbatches=microbatches, **kwargs)


def one_f_one_b(stages, loss_fn, optimizer, *, microbatches: int, **kwargs) -> SyncPipeline:
  """1F1B, PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, then one forward and one
  backward in turn; BP's update with at most min(M, K-k) micro-batches stashed on stage k."""
  return SyncPipeline("1f1b", stages, loss_fn, optimizer, microbatches=microbatches, **kwargs)
