"""`python -m fdg_jax.bench overhead`: one device only, the time per sample of each schedule
split into K stages (`devices=None`) over BP's unsplit K=1 time per sample, for both backward
policies (stash, recompute). The price of splitting and stashing, no concurrency.
"""

from __future__ import annotations

import itertools
import json
import statistics

from fdg_jax.bench.common import (POLICIES, REFERENCE, build_stages, call_paths,
                                  make_schedule, progress, random_batch, with_backward)
from fdg_jax.bench.timing import prepare, spread, time_interleaved


def _compiler_options(args) -> list[tuple[str, dict | None]]:
  """(label, Schedule's compiler_options) of each --compiler_options value."""
  return [(v, None) if v == "default" else (v, json.loads(v)) for v in args.compiler_options]


def bench_overhead(args, model) -> list[dict]:
  """Per-sample time on ONE device of each schedule split into K stages over BP K=1's.

  Each call path (`step`, `run`) is compared with BP K=1 through the same path. The ratio
  is taken per repetition against BP K=1's interleaved repetition, then the median. At each
  K, BP split into K stages is timed too, then each delayed schedule of --algorithms under
  each backward policy.
  """
  import jax
  dev = jax.devices()[0]
  batch = random_batch(model, args.batch_size, dev)
  _, stages1, params1, states1 = build_stages(model, 1, args.split, args.batch_size)
  Ks = [k for k in args.stages if k > 1]
  split = {K: build_stages(model, K, args.split, args.batch_size) for K in Ks}
  rows, entries, bases = [], [], []
  for (path, T), (label, options), gate in itertools.product(
      call_paths(args), _compiler_options(args), args.gates):
    base = len(entries)
    common = {"path": path, "compiler_options": label}
    rows.append({"algorithm": REFERENCE, "num_stages": 1, "backward": None, **common})
    entries.append(prepare(make_schedule(REFERENCE, stages1, compiler_options=options),
                           params1, states1, batch, run_ticks=T))
    bases.append(base)
    for K in Ks:
      _, stages, params, states = split[K]
      variants = [(REFERENCE, None)] + [(a, p) for a in with_backward(args.algorithms)
                                        for p in POLICIES]
      for algorithm, policy in variants:
        schedule = make_schedule(algorithm, stages, backward=policy or "stash", devices=None,
                                 compiler_options=options,
                                 gate=None if gate == "default" else gate)
        entries.append(prepare(schedule, params, states, batch, run_ticks=T))
        # BP has no traced flags: nothing to gate
        rows.append({"algorithm": algorithm, "num_stages": K, "backward": policy, **common,
                     "gate": schedule.gate if algorithm != REFERENCE else "–"})
        bases.append(base)
  times = time_interleaved(entries, ticks=args.ticks, repeats=args.repeats)
  for row, t, base in zip(rows, times, bases):
    b = times[base]["step"]
    ratios = [x / y for x, y in zip(t["step"], b)]
    row.update(time_per_sample_s=spread([x / args.batch_size for x in t["step"]]),
               ratio_vs_bp=statistics.median(ratios), ratio_vs_bp_spread=spread(ratios),
               # Fastest over fastest: the least disturbed repetitions of a shared machine.
               ratio_of_minima=min(t["step"]) / min(b))
    progress(f"overhead {row['path']} {row['compiler_options']} {row.get('gate', '')} "
             f"{row['algorithm']} "
             f"K={row['num_stages']} "
             f"{row['backward'] or ''}: x{row['ratio_vs_bp']:.3f}")
  del entries
  return rows


def overhead_table(rows) -> str:
  # The compiler-options column only where rows differ in it; the gate where one is set.
  options = len({r.get("compiler_options", "default") for r in rows}) > 1
  gates = any("gate" in r for r in rows)
  lines = ["| path | " + ("compiler options | " if options else "") +
           ("gate | " if gates else "") +
           "algorithm | K | backward | µs per sample, median [min, max] | "
           "× BP K=1 (same path), median [min, max] | × BP K=1, min / min |",
           "|---|---|---|---|---|---|---|" + ("---|" if options else "") +
           ("---|" if gates else "")]
  for r in rows:
    s, q = r["time_per_sample_s"], r["ratio_vs_bp_spread"]
    col = f" {r.get('compiler_options', 'default')} |" if options else ""
    col += f" {r.get('gate', '–')} |" if gates else ""
    lines.append(f"| {r.get('path', 'step')} |{col} {r['algorithm'].upper()} | "
                 f"{r['num_stages']} | "
                 f"{r['backward'] or '–'} | "
                 f"{1e6 * s['median']:.2f} [{1e6 * s['min']:.2f}, {1e6 * s['max']:.2f}] | "
                 f"{r['ratio_vs_bp']:.3f} [{q['min']:.3f}, {q['max']:.3f}] | "
                 f"{r['ratio_of_minima']:.3f} |")
  return "\n".join(lines)
