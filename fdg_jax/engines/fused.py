"""The fused engine: every stage in one program on one device.

`step` runs one tick as one jitted program; `run` runs T ticks as one program (a device
loop, `Schedule.scan`) or, where the platform runs nested backward convolutions slowly, the
one-tick program T times. The warm-up flags are traced from the tick and gate the pipeline
fill, so one program serves every tick (masking measured at 3-10% of a steady tick of the
quick-start MLP on CPU, traded for not compiling a second, unmasked variant): `FusedOps`
masks a gated stage's effects (`gate="mask"`), `GatedOps` runs it under a conditional
(`gate="cond"`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax import ring
from fdg_jax.engines import base
from fdg_jax.engines.fused_ops import FusedOps, GatedOps
from fdg_jax.engines.per_stage import run_by_steps
from fdg_jax.interpreter import run_tick
from fdg_jax.stage_math import NO_UPDATE


@base.register
class FusedEngine(base.Engine):
  """See the module docstring."""

  name = "fused"

  @classmethod
  def refusal(cls, plan, placement, *, telemetry: bool) -> str | None:
    why = cls.plan_refusal(plan)
    if why:
      return why
    if placement.single_device is None:
      return ("engine='fused' runs every stage in one program on one device; pass "
              "devices=None (or K copies of one device), or engine='per_stage'")
    return None

  def __init__(self, schedule):
    super().__init__(schedule)
    self.ops = {"mask": FusedOps(schedule.math), "cond": GatedOps(schedule.math)}

  def program(self, num_ticks: int | None):
    """The jitted program: one tick, or a loop of up to `num_ticks` ticks.

    One tick: (packed stages, inbox, (x, y), t) -> (packed stages, inbox, updated, metrics).
    Loop: (packed stages, inbox, xs, ys, t0, n) -> (packed stages, inbox, stacked metrics).
    """
    key = ("fused", num_ticks)
    if key in self.fns:
      return self.fns[key]
    s = self.schedule
    math, plan, K = s.math, s.plan, s.num_stages
    ops = self.ops[s.gate]

    def unpack_all(packed):
      return [math.unpack_stage(k, p) for k, p in enumerate(packed)]

    def pack_all(stages):
      return [math.pack_stage(k, st) for k, st in enumerate(stages)]

    if num_ticks is None:
      def one(packed, heads, inbox, batch, t):
        stages = unpack_all(ring.with_heads(packed, heads))
        stages, inbox, updated, metrics, _ = run_tick(plan, math, ops, stages, inbox, batch, t)
        return pack_all(stages), inbox, updated, metrics
      jitted = s.jit(one, donate_argnums=(0, 2))
    else:
      def many(packed, heads, inbox, xs, ys, t0, n):
        def body(i, carry):
          stages, inbox = carry
          batch = jax.tree.map(lambda a: a[i], (xs, ys))
          stages, inbox, updated, metrics, active = run_tick(plan, math, ops, stages, inbox,
                                                             batch, t0 + i)
          row = {**metrics, "valid": jnp.asarray(active),
                 "updated": jnp.stack([jnp.int32(NO_UPDATE) if u is None else u
                                       for u in updated])}
          return (stages, inbox), row

        stages = unpack_all(ring.with_heads(packed, heads))
        (stages, inbox), outs = base.loop_ticks(body, (stages, inbox), n, num_ticks,
                                                s.metrics_spec(), (K,))
        return pack_all(stages), inbox, outs
      jitted = s.jit(many, donate_argnums=(0, 2))

    fn = base.HeadsApart(jitted, one_stage=False)
    self.fns[key] = fn
    return fn

  def step(self, state, batch):
    s, K = self.schedule, self.schedule.num_stages
    batch_msg = s.placement.put_batch(0, tuple(batch))
    state = s.ready(state, batch_msg)
    t = int(state["tick"])
    stages, inbox, updated, metrics = self.program(None)(
        state["stages"], state.get("inbox"), batch_msg, np.int32(t))
    # A masked program computes every stage's work; keep what the tick really did.
    flags = [s.plan.flags(k, t) for k in range(K)]
    updated = [u if f[1] else None for u, f in zip(updated, flags)]
    if not flags[K - 1][0]:
      metrics = {}
    return s.plan.kind.finish(stages, inbox, updated, metrics, t, s.num_stages)

  def run(self, state, xs, ys, T, length):
    s = self.schedule
    if s.plan.kind.one_program_per_tick or not s.scan:  # one program per tick
      return run_by_steps(self, state, xs, ys, T, length)
    t0 = int(state["tick"])
    first = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), (xs, ys))
    state = s.ready(state, first)
    xs, ys = jax.device_put((xs, ys), s.placement.single_device)
    stages, inbox, out = self.program(length)(state["stages"], state["inbox"], xs, ys,
                                              np.int32(t0), np.int32(T))
    out["tick"] = base.ticks(t0, T, length)
    return {"tick": np.asarray(t0 + T, np.int64), "stages": stages, "inbox": inbox}, out
