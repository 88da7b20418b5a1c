"""Time to the first tick with JAX's persistent compilation cache, cold and warm.

    python benchmarks/compile_cache.py                      # ResNet-110, K=4 (~6 min on 2 cores)
    python benchmarks/compile_cache.py --model resnet20 --repeats 1

Each measurement is a fresh process (as a resumed or repeated run is): it builds the model,
splits it into K balanced stages, makes the FDG schedule (fused: every stage in one program
on one device; per_stage: a device per stage, 4 CPU devices) and times, from the start of the
process, the first `run` call of the trainer's path (2 ticks, compilation included). "cold"
runs with an empty cache directory, "warm" with the directory the cold run filled. Prints,
per engine, median [min, max] over --repeats of: seconds to the first tick done (from the
process start) and of the first call alone; writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

START = time.time()


def child(args) -> None:
  import jax
  jax.config.update("jax_num_cpu_devices", 4)
  from fdg_jax.runtime import compile_cache
  compile_cache.enable(args.cache)
  import numpy as np
  import optax
  import fdg_jax
  from fdg_jax.bench import common as B
  model = B.build_model(args.model, {}, None)
  _, stages, params, states = B.build_stages(model, args.stages, "balanced", args.batch_size)
  loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  devices = None if args.engine == "fused" else jax.devices()[:args.stages]
  sched = fdg_jax.fdg(stages, loss, optax.sgd(0.1, momentum=0.9), devices=devices)
  state = sched.init(params, states)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(2, args.batch_size) + tuple(model.input_shape)).astype(np.float32)
  ys = rng.integers(0, 10, size=(2, args.batch_size)).astype(np.int32)
  t0 = time.time()
  state, m = sched.run(state, (xs, ys))
  jax.block_until_ready((state, m))
  done = time.time()
  print(json.dumps({"first_tick_s": done - START, "first_call_s": done - t0}))


def measure(args, engine: str, cache: str) -> dict:
  cmd = [sys.executable, __file__, "--child", "--engine", engine, "--cache", cache,
         "--model", args.model, "--stages", str(args.stages),
         "--batch_size", str(args.batch_size)]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="resnet110")
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--engines", nargs="+", default=["fused", "per_stage"])
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--out", default="")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--engine", default="fused", help=argparse.SUPPRESS)
  parser.add_argument("--cache", default="off", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    child(args)
    return 0
  rows = {e: {"cold": [], "warm": []} for e in args.engines}
  for r in range(args.repeats):
    for engine in args.engines:
      with tempfile.TemporaryDirectory(prefix="fdg_jax_cache_") as cache:
        rows[engine]["cold"].append(measure(args, engine, cache))
        rows[engine]["warm"].append(measure(args, engine, cache))
        print(f"repeat {r}, {engine}: cold {rows[engine]['cold'][-1]}, "
              f"warm {rows[engine]['warm'][-1]}", flush=True)
  fmt = lambda xs: (f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]")
  print(f"\n{args.model}, K={args.stages}, batch {args.batch_size}, FDG, 2 ticks per call; "
        "seconds, median [min, max]:\n")
  print("| engine | cache | to the first tick (from process start) | first call |")
  print("|---|---|---|---|")
  for engine, by in rows.items():
    for kind in ("cold", "warm"):
      first = [m["first_tick_s"] for m in by[kind]]
      call = [m["first_call_s"] for m in by[kind]]
      print(f"| {engine} | {kind} | {fmt(first)} | {fmt(call)} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
