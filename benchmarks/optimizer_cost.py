"""What each optimiser of the delay-robust study costs: state memory and time per tick.

    python benchmarks/optimizer_cost.py                  # ~3 min on 2 CPU cores
    python benchmarks/optimizer_cost.py --model gpt --repeats 9

For the study's ViT (digits, 16 tokens, width 64, 6 blocks) or GPT (64 bytes, width 64,
6 blocks), batch 32, as BP K=1 on one device (`fdg_jax.bp`, the fused engine, `run` over
--ticks ticks per call), with adamw, muon, basis_rotation (bases every 10 steps) and
nadam_warmup. Prints, per optimiser: the optimiser state's bytes against the parameters',
and the seconds per tick, median [min, max] over --repeats calls, the optimisers taking
turns (so a noisy machine slows them alike), and the ratio to AdamW. Writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np
import optax

import fdg_jax
from fdg_jax import models, optim, partition

OPTIMIZERS = {
    "adamw": ("adamw", 1e-3, {}),
    "muon": ("muon", 0.02, {"adam_learning_rate": 1e-3}),
    "basis_rotation": ("basis_rotation", 1e-3, {}),
    "nadam_warmup": ("nadam_warmup", 1e-3, {}),
}


def workload(name: str):
  if name == "vit":
    model = models.create("vit", num_classes=10, input_shape=(8, 8, 1), patch_size=2, dim=64,
                          depth=6, num_heads=4)
    x = np.zeros((1, 8, 8, 1), np.float32)
    loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def batches(rng, ticks, batch):
      return (rng.normal(size=(ticks, batch, 8, 8, 1)).astype(np.float32),
              rng.integers(0, 10, size=(ticks, batch)).astype(np.int32))
  else:
    model = models.create("gpt", num_classes=256, seq_len=64, dim=64, depth=6, num_heads=4)
    x = np.zeros((1, 64), np.int32)
    loss = lambda logits, y: models.lm_loss(logits, y)

    def batches(rng, ticks, batch):
      toks = rng.integers(0, 256, size=(ticks, batch, 65)).astype(np.int32)
      return toks[..., :-1], toks[..., 1:]
  return model, x, loss, batches


def nbytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)
             if hasattr(a, "shape"))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=("vit", "gpt"), default="vit")
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--ticks", type=int, default=20, help="ticks per timed call")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  # On XLA:CPU with one or two devices, basis_rotation's refreshes inside `run`'s loop were
  # seen to hang (docs/troubleshooting.md); four forced devices avoid it.
  jax.config.update("jax_num_cpu_devices", 4)
  model, x, loss, batches = workload(args.model)
  stages = partition.split(model, 1, "uniform", example_input=x)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
  data = batches(np.random.default_rng(0), args.ticks, args.batch_size)
  runs = {}
  for name, (opt, lr, kw) in OPTIMIZERS.items():
    tx = optim.make_optimizer(opt, lr, momentum=0.0, **kw)
    schedule = fdg_jax.bp(stages, loss, tx)
    state = schedule.init(params, states)
    state, m = schedule.run(state, data)  # compile
    jax.block_until_ready(m)
    runs[name] = {"schedule": schedule, "state": state, "times": [],
                  "opt_bytes": nbytes(tx.init(params[0]))}
  param_bytes = nbytes(params[0])
  for _ in range(args.repeats):
    for name, r in runs.items():
      t0 = time.perf_counter()
      r["state"], m = r["schedule"].run(r["state"], data)
      jax.block_until_ready(m)
      r["times"].append((time.perf_counter() - t0) / args.ticks)
  base = statistics.median(runs["adamw"]["times"])
  print(f"{args.model}, batch {args.batch_size}, BP K=1 on one {jax.devices()[0].platform} "
        f"device; parameters {param_bytes / 2**20:.2f} MiB")
  print("| optimizer | state MiB | state / params | ms per tick, median [min, max] | × adamw |")
  print("|---|---|---|---|---|")
  out = {"model": args.model, "batch_size": args.batch_size, "param_bytes": param_bytes,
         "platform": jax.devices()[0].platform, "optimizers": {}}
  for name, r in runs.items():
    t = r["times"]
    med = statistics.median(t)
    print(f"| {name} | {r['opt_bytes'] / 2**20:.2f} | {r['opt_bytes'] / param_bytes:.2f} | "
          f"{1e3 * med:.2f} [{1e3 * min(t):.2f}, {1e3 * max(t):.2f}] | {med / base:.2f} |")
    out["optimizers"][name] = {"state_bytes": r["opt_bytes"], "s_per_tick": t,
                               "median_ratio_to_adamw": med / base}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
