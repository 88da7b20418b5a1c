"""The per-stage engine: a device per stage (or a (data, stage) mesh), each call jitted there.

Each stage's work at a tick is its own jitted program on its devices, over its packed state
(donated), and messages move between the stages with the schedule's `Placement`
(`jax.device_put`; shard by shard in a multi-process run). `step` runs one tick from the
host, `run` runs T ticks as T steps. A plan that accumulates (GPipe, 1F1B) calls each
micro-batch action as its own program, and the host holds each forward's vjp residuals
until the stage's backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax import ring
from fdg_jax.engines import base
from fdg_jax.interpreter import run_tick
from fdg_jax.stage_math import NO_UPDATE


class PerStageOps:
  """Each stage's work a jitted call on its devices; explicit moves between them."""

  old_messages_first = False  # see `interpreter.run_tick`

  def __init__(self, engine):
    self.engine = engine
    self.schedule = engine.schedule

  def begin_tick(self):
    pass

  def call(self, k, do_fwd, do_bwd):
    # the host calls the last stage only when it is active
    return self.engine.stage_call(k, do_fwd, do_bwd)

  def move(self, k, tree):
    return self.schedule.placement.put_batch(k, tree)

  def move_all(self, messages):
    # One batched device_put: its host cost per call dominates the dispatch of small stages.
    return self.schedule.placement.put_batches(messages)

  # A plan that accumulates: each micro-batch action a jitted call on its stage's devices.
  def forward_micro(self, k):
    fn = self.engine.cached(("F", k), lambda: jax.jit(
        functools.partial(self.schedule.math.micro_forward, k)))
    return lambda s, x, t, m: fn(s, x, t, np.int32(m))

  def last_micro(self):
    fn = self.engine.cached(("L",), lambda: jax.jit(self.schedule.math.micro_last))
    return lambda s, x, y, t, m: fn(s, x, y, t, np.int32(m))

  def backward_micro(self, k):
    return self.engine.cached(("B", k), lambda: jax.jit(
        functools.partial(self.schedule.math.micro_backward, k)))

  def apply_sum(self, k):
    return self.engine.cached(("U", k), lambda: jax.jit(
        functools.partial(self.schedule.math.apply_sum, k), donate_argnums=0))


@base.register
class PerStageEngine(base.Engine):
  """See the module docstring."""

  name = "per_stage"

  def __init__(self, schedule):
    super().__init__(schedule)
    self.ops = PerStageOps(self)

  def cached(self, key, make):
    if key not in self.fns:
      self.fns[key] = make()
    return self.fns[key]

  def stage_call(self, k: int, do_forward: bool, do_backward: bool):
    """Stage k's call as a jitted program on its devices, over its packed state (donated):
    (packed state, activation message, cotangent) -> (packed state, activation out,
    cotangent out, batch updated, metrics). For the last stage the flags are True."""
    key = (k, do_forward, do_backward)
    if key in self.fns:
      return self.fns[key]
    s = self.schedule
    math, shapes, P = s.math, s.shapes, s.placement
    last = k == s.num_stages - 1

    def call(packed, heads, act, cot):
      st = math.unpack_stage(k, ring.with_heads([packed], heads)[0])
      if last:
        st, act_out, cot_out, updated, metrics = math.call(k, st, act, None, True, True)
      else:
        st, act_out, cot_out, updated = math.stage_with_ring(k, st, act, cot, do_forward,
                                                             do_backward)
        metrics = {}
      return math.pack_stage(k, st), act_out, cot_out, updated, metrics

    # Fixed output shardings: the state comes back exactly as it went in (so the next tick
    # hits the same compiled variant, also under a mesh, where propagation would otherwise
    # pick the stash's sharding), and messages leave sharded like the batch.
    out_shardings = (shapes.state_shardings(k),
                     shapes.act_shardings[k] if do_forward and not last else None,
                     shapes.cot_shardings[k] if do_backward and k > 0 else None,
                     P.scalar_shardings[k] if do_backward else None,
                     P.scalar_shardings[k] if last else None)
    fn = base.HeadsApart(s.jit(call, donate_argnums=0, out_shardings=out_shardings),
                         one_stage=True)
    self.fns[key] = fn
    return fn

  def step(self, state, batch):
    s = self.schedule
    # In a multi-process run `batch` is this process's slice; batch_msg is the global batch.
    batch_msg = s.placement.put_batch(0, tuple(batch))
    state = s.ready(state, batch_msg)
    t = int(state["tick"])
    stages, inbox, updated, metrics, _ = run_tick(s.plan, s.math, self.ops, state["stages"],
                                                  state.get("inbox"), batch_msg, t)
    return s.plan.kind.finish(stages, inbox, updated, metrics, t, s.num_stages)

  def run(self, state, xs, ys, T, length):
    return run_by_steps(self, state, xs, ys, T, length)


def run_by_steps(engine, state, xs, ys, T, length):
  """`run` as T calls of `engine.step`, the metrics stacked on the last stage's devices."""
  schedule = engine.schedule
  K, P = schedule.num_stages, schedule.placement
  t0 = int(state["tick"])
  per_tick = []
  for batch in base.unstack((xs, ys), T):
    state, m = engine.step(state, batch)
    per_tick.append(m)
  per_tick += [{"updated": (None,) * K}] * (length - T)  # unset entries past T
  spec = schedule.metrics_spec(per_tick[0])
  fills = {name: schedule.constant(K - 1, 0, leaf.dtype) for name, leaf in spec.items()}
  out = base.stack({name: [m.get(name, fill) for m in per_tick]
                    for name, fill in fills.items()})
  columns = []
  for k in range(K):
    none = schedule.constant(k, NO_UPDATE, jnp.int32)
    columns.append(base.stack([none if m["updated"][k] is None else m["updated"][k]
                               for m in per_tick]))
  columns = P.put_replicated(K - 1, columns)
  out["updated"] = base.stack(columns, axis=1)
  out["valid"] = np.asarray(["loss" in m for m in per_tick])
  out["tick"] = base.ticks(t0, T, length)
  return state, out
