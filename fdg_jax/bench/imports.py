"""What `import fdg_jax` costs on top of `import jax`, measured side by side.

    python -m fdg_jax.bench imports [--rounds 10] [--out F.json]

Each round starts a fresh interpreter for `import jax` and one for `import fdg_jax` (in
turn, the order alternating), timed from start to exit; the figure is the median of the
per-round differences, with its range. The library imports its heavy dependencies (the
datasets, orbax, the metric writers, flax) where they are first used, so that this stays
small: the target is at most 0.3 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TARGET_S = 0.3


def _time(module: str) -> float:
  t0 = time.perf_counter()
  subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
  return time.perf_counter() - t0


def measure(rounds: int) -> dict:
  _time("fdg_jax")  # warm the file cache for both
  jax_s, fdg_s = [], []
  for i in range(rounds):
    pair = [("jax", jax_s), ("fdg_jax", fdg_s)]
    for module, out in (pair if i % 2 == 0 else pair[::-1]):
      out.append(_time(module))
  diffs = [f - j for f, j in zip(fdg_s, jax_s)]
  return {"import_jax_s": statistics.median(jax_s), "import_fdg_jax_s": statistics.median(fdg_s),
          "extra_s": statistics.median(diffs), "extra_min_s": min(diffs),
          "extra_max_s": max(diffs), "rounds": rounds, "target_s": TARGET_S}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m fdg_jax.bench imports",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  r = measure(args.rounds)
  met = "met" if r["extra_s"] <= TARGET_S else "missed"
  print(f"import jax {r['import_jax_s']:.2f} s, import fdg_jax {r['import_fdg_jax_s']:.2f} s "
        f"(medians of {args.rounds} fresh interpreters each, in turn): fdg_jax adds "
        f"{r['extra_s']:.3f} s [{r['extra_min_s']:.3f}, {r['extra_max_s']:.3f}] "
        f"(target <= {TARGET_S} s: {met})")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(r, f, indent=1)
  return r
