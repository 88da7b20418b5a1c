"""An engine written outside the library, as a user would: one module and one line
(`@engines.register`). It runs each tick eagerly, op by op, on the one device every stage
lies on, through the library's interpreter and masked ops (no program is compiled)."""

import numpy as np

from fdg_jax import engines, ring
from fdg_jax.engines.fused_ops import FusedOps
from fdg_jax.engines.per_stage import run_by_steps
from fdg_jax.interpreter import run_tick


@engines.register
class EagerEngine(engines.Engine):
  name = "eager_test"

  @classmethod
  def refusal(cls, plan, placement, *, telemetry: bool):
    if placement.single_device is None:
      return "engine='eager_test' runs every stage on one device"
    return None

  def step(self, state, batch):
    s, K = self.schedule, self.schedule.num_stages
    batch = s.placement.put_batch(0, tuple(batch))
    state = s.ready(state, batch)
    t = int(state["tick"])
    math = s.math
    packed, heads = ring.without_heads(state["stages"])
    stages = [math.unpack_stage(k, p) for k, p in enumerate(ring.with_heads(packed, heads))]
    stages, inbox, updated, metrics, _ = run_tick(s.plan, math, FusedOps(math), stages,
                                                  state.get("inbox"), batch, np.int32(t))
    flags = [s.plan.flags(k, t) for k in range(K)]
    updated = [u if f[1] else None for u, f in zip(updated, flags)]
    if not flags[K - 1][0]:
      metrics = {}
    packed = [math.pack_stage(k, st) for k, st in enumerate(stages)]
    return s.plan.kind.finish(packed, inbox, updated, metrics, t, K)

  def run(self, state, xs, ys, T, length):
    return run_by_steps(self, state, xs, ys, T, length)
