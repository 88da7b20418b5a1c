"""`python -m fdg_jax.bench throughput`: samples/s and step time of each schedule asked for
(--algorithms) for one model and global batch at each K in --stages; stages on K distinct
devices when there are K, else all on one.
"""

from __future__ import annotations

from fdg_jax import plans as plans_lib
from fdg_jax.bench.common import (build_stages, make_schedule, placement_for, progress,
                                  random_batch)
from fdg_jax.bench.timing import prepare, spread, time_interleaved


def bench_throughput(args, model) -> list[dict]:
  """samples/s and step time of every algorithm at every K, same model and global batch."""
  rows, entries = [], []
  for K in args.stages:
    bounds, stages, params, states = build_stages(model, K, args.split, args.batch_size)
    devices, where = placement_for(K)
    batch = random_batch(model, args.batch_size, devices[0] if devices else None)
    for algorithm in args.algorithms:
      M = args.sync_microbatches if plans_lib.spec(algorithm).microbatched else None
      if M is not None and args.batch_size % M:
        raise ValueError(f"--batch_size {args.batch_size} is not a multiple of "
                         f"--sync_microbatches {M}")
      schedule = make_schedule(algorithm, stages, backward=args.backward, devices=devices,
                               microbatches=M or 1)
      entries.append(prepare(schedule, params, states, batch))
      rows.append({
          "algorithm": algorithm, "num_stages": K, "boundaries": bounds, "placement": where,
          "backward": (args.backward if "backward" in plans_lib.spec(algorithm).options
                       else None),
          "microbatches": M, "host_calls_per_tick": host_calls_per_tick(schedule),
          "peak_stash": list(schedule.ring_sizes),
          "batch_size": args.batch_size, "ticks": args.ticks, "repeats": args.repeats})
  times = time_interleaved(entries, ticks=args.ticks, repeats=args.repeats)
  for row, t in zip(rows, times):
    row.update(step_time_s=spread(t["step"]), host_time_s=spread(t["host"]),
               samples_per_s=spread([args.batch_size / x for x in t["step"]]),
               loss_finite=t["loss_finite"])
    progress(f"throughput {row['algorithm']} K={row['num_stages']} ({row['placement']}): "
             f"{row['samples_per_s']['median']:.0f} samples/s")
  del entries
  return rows


def host_calls_per_tick(schedule) -> int:
  """Jitted calls the per-stage engine makes per steady tick: one per call of the plan
  (BP and DDG 2K-1, FDG K); a synchronous pipeline's M forwards and M-per-stage backwards
  (K M + (K-1) M) and one update per stage."""
  plan = getattr(schedule, "plan", None)
  if plan is not None:
    return len(plan.calls)
  K, M = schedule.num_stages, schedule.microbatches
  return K * M + (K - 1) * M + K


def throughput_table(rows) -> str:
  lines = ["| schedule | K | placement | step time ms, median [min, max] | samples/s median | "
           "host calls per tick | peak stash per stage (slots; micro-batches where M is "
           "given) |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    s = r["step_time_s"]
    name = r["algorithm"].upper() + (f" M={r['microbatches']}" if r.get("microbatches") else "")
    lines.append(f"| {name} | {r['num_stages']} | {r['placement']} | "
                 f"{1e3 * s['median']:.2f} [{1e3 * s['min']:.2f}, {1e3 * s['max']:.2f}] | "
                 f"{r['samples_per_s']['median']:,.0f} | {r.get('host_calls_per_tick', '–')} | "
                 f"{', '.join(map(str, r.get('peak_stash', []))) or '–'} |")
  return "\n".join(lines)
