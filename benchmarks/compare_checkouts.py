"""The engines' overhead and dispatch figures of two checkouts, measured side by side.

    git worktree add /tmp/old <commit>
    python benchmarks/compare_checkouts.py /tmp/old --rounds 3

Runs `python -m fdg_jax.bench overhead` and `python -m fdg_jax.bench dispatch` in each checkout
in turn (old, new, old, new, ...: a machine whose speed drifts moves both alike) with the
same arguments, and prints per figure the median over rounds of each checkout and new/old.
Figures: `overhead`'s per-sample ratio to BP K=1 on one device (each schedule and backward
policy), `dispatch`'s host time per stage per tick (each engine and schedule). Each checkout
imports its own `fdg_jax` (the command runs in its directory).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def figures(kind: str, rows: list[dict]) -> dict[str, float]:
  out = {}
  for r in rows:
    if kind == "overhead":
      key = (f"overhead {r['algorithm']} K={r['num_stages']} {r['backward'] or ''} "
             f"{r.get('path', 'step')} (x BP K=1)")
      out[key.replace("  ", " ")] = r["ratio_vs_bp"]
    else:
      key = (f"dispatch {r['algorithm']} K={r['num_stages']} {r.get('engine', 'per_stage')} "
             f"{r.get('path', 'step')} (host us/stage-tick)")
      out[key] = 1e6 * r["host_time_per_stage_tick_s"]["median"]
  return out


def run(checkout: pathlib.Path, kind: str, extra: list[str], out: str) -> dict[str, float]:
  cmd = [sys.executable, "-m", "fdg_jax.bench", kind, *extra, "--out", out]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
  with open(out) as f:
    return figures(kind, json.load(f)[kind])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("old", help="the other checkout (a directory with fdg_jax/)")
  parser.add_argument("--new", default=str(ROOT))
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--overhead_args", default="--stages 4 --repeats 5",
                      help="arguments of `bench overhead`")
  parser.add_argument("--dispatch_args",
                      default="--stages 4 --algorithms bp ddg fdg --repeats 5",
                      help="arguments of `bench dispatch`")
  parser.add_argument("--kinds", nargs="+", choices=("overhead", "dispatch"),
                      default=["overhead", "dispatch"], help="the benchmarks run")
  args = parser.parse_args(argv)
  sides = {"old": pathlib.Path(args.old).resolve(), "new": pathlib.Path(args.new).resolve()}
  for name, path in sides.items():
    if not (path / "fdg_jax" / "bench").is_dir():
      print(f"error: {path} ({name}) has no fdg_jax/bench: give a checkout of this repository",
            file=sys.stderr)
      return 2
  seen: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(args.rounds):
      for kind, extra in (("overhead", args.overhead_args), ("dispatch", args.dispatch_args)):
        if kind not in args.kinds:
          continue
        for name, path in sides.items():
          out = os.path.join(tmp, f"{name}_{kind}_{i}.json")
          for key, value in run(path, kind, extra.split(), out).items():
            seen[name].setdefault(key, []).append(value)
          print(f"round {i + 1}/{args.rounds}: {kind} {name} done", file=sys.stderr)
  print("| figure | old, median [min, max] | new, median [min, max] | new / old |")
  print("|---|---|---|---|")
  for key in seen["new"]:
    o, n = seen["old"].get(key), seen["new"][key]
    fmt = lambda v: f"{statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]"  # noqa: E731
    ratio = f"{statistics.median(n) / statistics.median(o):.3f}" if o else "–"
    print(f"| {key} | {fmt(o) if o else '–'} | {fmt(n)} | {ratio} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
