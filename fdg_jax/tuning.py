"""Platform tuning of a schedule's programs: measured defaults, each with its reason.

- `compiler_options_for(platform)`: XLA options for the programs that run ticks.
- `default_scan(platform, has_conv)`: whether the fused `run` loops over its ticks on the
  device.
- `default_gate(...)`: how the fused engine gates a stage's work during the pipeline fill.
- `forward_flops(...)`: each stage's training forward FLOPs, which `default_gate` reads.
"""

from __future__ import annotations

import jax

# The largest training forward (FLOPs, one stage, one tick) for which FDG's fused programs
# on CPU gate their stages with chained conditionals by default (`default_gate`): the
# quick-start MLP's stages do 0.5-1.1 MFLOP and gain; larger ticks gain less or lose
# (benchmarks/gates.py, docs/notes.md 3.11).
COND_GATE_MAX_FLOPS = 3e6


def compiler_options_for(platform: str) -> dict:
  """XLA options for the programs that run ticks on `platform` (per program, not global).

  XLA:CPU: copy insertion with region analysis. By default XLA:CPU copies every
  loop-carried value whose old and new versions are both live within a loop iteration,
  which a tick's state always is (a stage reads last tick's message while the stage below
  writes this tick's; the update reads the parameters the forward then uses). Region
  analysis proves those copies unneeded: the quick-start MLP's FDG K=4 loop body went
  from 40 copies to none, and its time per sample from 1.8-1.9x BP K=1's to 1.4-1.5x; it
  also updates the stash rings in place without their heads (`ring_heads`; docs/notes.md
  3.9). GPUs and TPUs keep XLA's defaults (not measured there).
  """
  if platform == "cpu":
    return {"xla_cpu_copy_insertion_use_region_analysis": True}
  return {}


def default_scan(platform: str, has_conv: bool) -> bool:
  """Whether the fused `run` scans its ticks (else it calls a one-tick program T times):
  scan, except on CPU for models with convolutions, whose backward XLA:CPU runs 10-40x
  slower inside a loop body than at the top level of a program."""
  return not (platform == "cpu" and has_conv)


def default_gate(platform: str, plan, backward: str, has_conv: bool, flops) -> str:
  """How the fused engine gates a stage's work on traced flags: "mask" or "cond".

  "cond" for FDG with `backward="stash"` on CPU where the ticks are small (no convolution,
  and no stage's training forward above `COND_GATE_MAX_FLOPS`; `flops()` gives them),
  "mask" elsewhere. On a small tick the chained conditionals keep XLA:CPU from spreading
  the stages' independent kernels over its thread pool, which costs more than the overlap
  gains: the quick-start MLP's FDG K=4 loop takes 1.22-1.25x BP K=1's time per sample with
  them, 1.35-1.47x with masks, on the 2-core reference machine (K=2: 1.13x against 1.30x;
  K=5: 1.36x against 1.71x; docs/notes.md 3.11). On larger ticks the overlap pays: a GPT
  of width 128 at batch 16 x 128 tokens ran 1.25x slower with them. Measured mixed, so
  left on masks: `recompute` (K=4 5% slower, K=5 12% faster) and DDG (slower with
  `stash`, faster with `recompute`). A conditional's branches are nested computations, in
  which XLA:CPU runs backward convolutions slowly (see `default_scan`). GPUs and TPUs keep
  masks (not measured there; a GPU conditional reads its predicate back to the host).
  """
  small = (platform == "cpu" and plan.decoupled and backward == "stash"
           and not has_conv and max(flops()) <= COND_GATE_MAX_FLOPS)
  return "cond" if small else "mask"


def forward_flops(stages, shapes) -> list[float]:
  """Each stage's training forward's FLOPs at the prepared batch shapes, as XLA counts them
  in the lowered (unoptimised) program; inf where it cannot tell."""
  if not shapes.prepared:
    raise ValueError("the schedule's batch shapes are not known yet: call "
                     "schedule.init(..., example_batch=...) or run a tick first")
  flops = []
  for k, stage in enumerate(stages):
    s = shapes.core_spec(k)
    x = shapes.batch_spec[0] if k == 0 else shapes.act_specs[k - 1][0]
    fwd = lambda p, ms, a, st=stage: st.apply(p, ms, a, train=True,
                                              rng=jax.random.PRNGKey(0))[0]
    try:
      cost = jax.jit(fwd).lower(s["params"], s["model_state"], x).cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      flops.append(float(cost["flops"]))
    except Exception:  # no cost model on this backend or version
      flops.append(float("inf"))
  return flops
