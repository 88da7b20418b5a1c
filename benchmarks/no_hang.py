"""`basis_rotation` on CPU: every engine x device count x call finishes (and how fast).

    python benchmarks/no_hang.py                 # the 12 cases, 240 s each at most
    python benchmarks/no_hang.py --blas_threads  # plus the one-device run with SciPy's
                                                 # OpenBLAS left multi-threaded, side by side

Each case is a fresh process under a timeout: the ViT of the digits configs (8x8 inputs,
patch 2) split uniformly into 4 stages, FDG with `fdg_jax.optimizers.basis_rotation(1e-3)`
(bases refreshed every 10 updates), 60 ticks of batch 32, as `run` (one call) or `step`
(60 calls), on the fused engine (every stage in one program) or per-stage (stage k on CPU
device k mod D), with D = 1, 2 or 4 forced CPU devices. Prints one row per case: finished or
wedged, seconds to the first tick (compilation) and for the 60 ticks; writes --out (JSON).
With jaxlib 0.10's batched LAPACK kernels these cases wedged on 1 and 2 devices before
`fdg_jax.optim.cpu_lapack` (its docstring says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def child(devices: int, engine: str, call: str, ticks: int, keep_blas_threads: bool) -> None:
  import jax
  jax.config.update("jax_num_cpu_devices", devices)
  import numpy as np
  import optax
  import fdg_jax
  from fdg_jax import models, optimizers, partition
  from fdg_jax.optim import adaptive
  if keep_blas_threads:  # the library's setting undone (where basis_rotation calls it)
    adaptive.single_threaded_scipy_blas = lambda: False
  model = models.create("vit", num_classes=10, input_shape=(8, 8, 1), patch_size=2)
  x = np.zeros((1, 8, 8, 1), np.float32)
  stages = partition.split(model, 4, "uniform", example_input=x)
  params, model_states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
  loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  devs = None if engine == "fused" else [jax.devices()[k % devices] for k in range(4)]
  schedule = fdg_jax.fdg(stages, loss, optimizers.basis_rotation(1e-3), devices=devs)
  state = schedule.init(params, model_states)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(ticks + 1, 32, 8, 8, 1)).astype(np.float32)
  ys = rng.integers(0, 10, size=(ticks + 1, 32)).astype(np.int32)
  t0 = time.time()
  state, m = schedule.step(state, (xs[0], ys[0]))  # compiles (step's programs)
  jax.block_until_ready(m)
  first = time.time() - t0
  t0 = time.time()
  if call == "run":
    state, m = schedule.run(state, (xs[1:], ys[1:]))
  else:
    for t in range(1, ticks + 1):
      state, m = schedule.step(state, (xs[t], ys[t]))
  last = float(np.asarray(m["loss"]).reshape(-1)[-1])
  print(json.dumps({"first_s": first, "ticks_s": time.time() - t0, "loss": last}))


def run_case(devices, engine, call, ticks, timeout, keep_blas_threads=False) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OPENBLAS_NUM_THREADS")}
  cmd = [sys.executable, os.path.abspath(__file__), "--child", str(devices), engine, call,
         str(ticks)] + (["--blas_threads"] if keep_blas_threads else [])
  row = {"devices": devices, "engine": engine, "call": call, "ticks": ticks,
         "blas_threads": keep_blas_threads}
  t0 = time.time()
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    return {**row, "result": f"wedged (no end within {timeout} s)"}
  row["wall_s"] = time.time() - t0
  if p.returncode != 0:
    return {**row, "result": "failed: " + (p.stderr.strip().splitlines() or ["?"])[-1]}
  return {**row, "result": "finished", **json.loads(p.stdout.strip().splitlines()[-1])}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
  ap.add_argument("--ticks", type=int, default=60)
  ap.add_argument("--timeout", type=float, default=240)
  ap.add_argument("--blas_threads", action="store_true")
  ap.add_argument("--out", default="docs/results/no_hang_cpu.json")
  args = ap.parse_args()
  if args.child:
    d, engine, call, ticks = args.child
    return child(int(d), engine, call, int(ticks), args.blas_threads)
  rows = []
  cases = [(d, e, c, False) for e in ("fused", "per_stage") for d in (1, 2, 4)
           for c in ("run", "step")]
  if args.blas_threads:
    cases += [(1, "fused", "run", True)]
  print("| engine | CPU devices | call | SciPy BLAS threads | result | first tick s | "
        f"{args.ticks} ticks s |\n|---|---|---|---|---|---|---|", flush=True)
  for d, e, c, keep in cases:
    r = run_case(d, e, c, args.ticks, args.timeout, keep)
    rows.append(r)
    f = lambda k: f"{r[k]:.1f}" if k in r else "-"
    print(f"| {e} | {d} | {c} | {'all cores' if keep else 1} | {r['result']} | "
          f"{f('first_s')} | {f('ticks_s')} |", flush=True)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump({"cases": rows}, fh, indent=1)
  wedged = [r for r in rows if r["result"] != "finished"]
  print(f"{len(rows) - len(wedged)} of {len(rows)} cases finished; wedged or failed: "
        f"{len(wedged)}")


if __name__ == "__main__":
  main()
