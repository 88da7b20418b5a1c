"""`python -m fdg_jax.bench dispatch`: host time per tick of a tiny model (return from
`schedule.step` or `schedule.run` without blocking), divided by K: the per-stage Python and
dispatch cost, for each engine that runs the schedule (a plan's calls per tick: BP and DDG
make 2K-1 jitted calls per tick on the per-stage engine, FDG K).
"""

from __future__ import annotations

from fdg_jax import engines
from fdg_jax import plans as plans_lib
from fdg_jax.bench.common import (TINY, build_model, build_stages, call_paths,
                                  first_place, jax_leaves, make_schedule, mesh_for,
                                  placement_for, progress, random_batch)
from fdg_jax.bench.timing import host_thread_pinned, prepare, spread, time_interleaved


def bench_dispatch(args) -> list[dict]:
  """Host time per tick (no blocking) of a tiny model, and per stage (÷ K).

  Each (algorithm, K) is timed through `step` and `run` (--paths), on K devices (the
  per-stage engine: a jitted call per stage, 2K-1 per tick for BP and DDG, K for FDG, plus
  the moves of the messages; for FDG also the SPMD engine: one program over the K devices
  per call, `step` being `run` with T = 1) and on one device (the fused engine: one
  program per call). With fewer than K devices (one GPU), the per-stage engine runs its K
  calls per tick on the one device instead, with no messages to move. With --replicas
  R > 1, on an R x K (data, stage) mesh instead: the per-stage engine (its calls span a
  stage's R devices) and the SPMD engine (one program over the R x K devices); the batch is
  the global one, R times --dispatch_batch. Each schedule runs on the engines its registry
  entry names; the micro-batched pipelines are timed by `throughput` only.
  """
  import jax
  if args.dispatch_model == "tiny":
    name, kwargs, shape, batch_size = TINY
    split = "uniform"
  else:
    name, kwargs, shape, batch_size = args.dispatch_model, {}, None, args.dispatch_batch
    if name == args.model:  # --model_kwargs and --input_shape apply to it
      kwargs, shape = args.model_kwargs, args.input_shape
    split = args.split
  model = build_model(name, kwargs, shape)
  R = args.replicas
  batch_size *= R
  rows, entries = [], []
  for K in args.stages:
    _, stages, params, states = build_stages(model, K, split, batch_size)
    if R > 1:
      mesh = mesh_for(R, K)
      places = [({"mesh": mesh}, f"{R}x{K} mesh", e) for e in ("per_stage", "spmd") if mesh]
    else:
      devices, where = placement_for(K)
      places = [({"devices": devices}, where, e) for e in ("per_stage", "spmd") if devices]
      if not devices and K > 1:
        # Fewer devices than stages (one GPU): the per-stage engine's K calls per tick on
        # the one device, so that its host cost is measured there too (no message moves).
        places.append(({"devices": [jax.devices()[0]] * K}, f"{K} stages on 1 device",
                       "per_stage"))
      places.append(({}, "1 device", "fused"))
    places = [p for p in places if p[2] in args.engines]
    for path, T in call_paths(args):
      for where, label, engine in places:
        batch = random_batch(model, batch_size, first_place(where))
        for algorithm in args.algorithms:
          spec = plans_lib.spec(algorithm)
          if spec.microbatched or engines.plan_refusal(engine, plans_lib.plan(algorithm, K)):
            continue  # an engine it does not run on; a micro-batched pipeline: throughput only
          schedule = make_schedule(algorithm, stages, engine=engine, **where)
          entries.append(prepare(schedule, params, states, batch, run_ticks=T))
          rows.append({"algorithm": algorithm, "num_stages": K, "placement": label,
                       "replicas": R, "engine": engine, "path": path,
                       "ticks": args.dispatch_ticks,
                       "model": model.name, "batch_size": batch_size,
                       "warmup_s": entries[-1]["warmup_s"],
                       "leaves_per_stage": [len(jax_leaves(s)) for s in
                                            entries[-1]["state"]["stages"]]})
  with host_thread_pinned(args.pin_host):
    times = time_interleaved(entries, ticks=args.dispatch_ticks, repeats=args.repeats)
  for row, t in zip(rows, times):
    K = row["num_stages"]
    row["host_pinned"] = bool(args.pin_host)
    row.update(host_time_per_tick_s=spread(t["host"]),
               host_time_per_stage_tick_s=spread([h / K for h in t["host"]]),
               idle_host_time_per_stage_tick_s=spread([h / K for h in t["host_idle"]]),
               host_cpu_time_per_stage_tick_s=spread([h / K for h in t["host_cpu"]]),
               step_time_s=spread(t["step"]))
    progress(f"dispatch {row['path']} {row['engine']} {row['algorithm']} K={K}: "
             f"{1e6 * row['host_time_per_stage_tick_s']['median']:.0f} µs/stage-tick")
  del entries
  return rows


def dispatch_table(rows) -> str:
  lines = ["| algorithm | K | path | placement (engine) | host µs per tick | host µs per stage "
           "per tick, median [min, max] | same, devices idle | host thread's CPU µs per "
           "stage per tick | blocked µs per tick | first call / warm-up s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    h, p = r["host_time_per_tick_s"], r["host_time_per_stage_tick_s"]
    idle = r.get("idle_host_time_per_stage_tick_s", {"median": float("nan")})
    cpu = r.get("host_cpu_time_per_stage_tick_s", {"median": float("nan")})
    lines.append(f"| {r['algorithm'].upper()} | {r['num_stages']} | {r.get('path', 'step')} | "
                 f"{r['placement']} ({r.get('engine', 'per_stage')}) | "
                 f"{1e6 * h['median']:.0f} | {1e6 * p['median']:.0f} [{1e6 * p['min']:.0f}, "
                 f"{1e6 * p['max']:.0f}] | {1e6 * idle['median']:.0f} | "
                 f"{1e6 * cpu['median']:.0f} | "
                 f"{1e6 * r['step_time_s']['median']:.0f} | "
                 f"{r.get('warmup_s', float('nan')):.1f} |")
  if rows and "model" in rows[0]:
    r = rows[0]
    lines += ["", f"model {r['model']}, batch {r['batch_size']}; packed state buffers per stage "
              f"(K={r['num_stages']}): {r['leaves_per_stage']}"]
    if r.get("host_pinned"):
      lines.append("host thread pinned to its own core (--pin_host)")
  return "\n".join(lines)
