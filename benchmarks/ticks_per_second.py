"""Ticks per second of BP, DDG and FDG on a small MLP, all stages on one device.

    python benchmarks/ticks_per_second.py [--width 256] [--batch 64] [--ticks 300] [--json out.json]

Each schedule runs past its pipeline fill (so every variant is compiled), then `--ticks` ticks
are timed between two `block_until_ready`s; the median of `--repeats` timings is reported,
with the bytes of every stage's delay buffer under both backward policies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fdg_jax


def mlp_stages(num_stages: int, width: int, depth: int = 8, num_classes: int = 10):
  """An MLP of `depth` dense-tanh layers and a head, cut into `num_stages` equal stages."""
  def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])

  def make_apply(n_layers, head):
    def apply(params, x):
      for p in params["layers"][:n_layers]:
        x = layer(p, x)
      return x @ params["head"]["w"] + params["head"]["b"] if head else x
    return apply

  rng = np.random.RandomState(0)
  per = [depth // num_stages + (1 if k < depth % num_stages else 0) for k in range(num_stages)]
  stages, params = [], []
  for k, n in enumerate(per):
    head = k == num_stages - 1
    p = {"layers": [{"w": jnp.asarray(rng.randn(width, width) / np.sqrt(width), jnp.float32),
                     "b": jnp.zeros(width)} for _ in range(n)]}
    if head:
      p["head"] = {"w": jnp.asarray(rng.randn(width, num_classes) / np.sqrt(width), jnp.float32),
                   "b": jnp.zeros(num_classes)}
    stages.append(fdg_jax.Stage.from_fn(make_apply(n, head)))
    params.append(p)
  return stages, params


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def measure(algorithm, num_stages, backward, args):
  stages, params = mlp_stages(num_stages, args.width)
  kwargs = {} if algorithm == "bp" else {"backward": backward}
  sched = fdg_jax.create(algorithm, stages, loss_fn, optax.sgd(0.01, momentum=0.9), **kwargs)
  rng = np.random.RandomState(1)
  batch = (jax.device_put(rng.randn(args.batch, args.width).astype(np.float32)),
           jax.device_put(rng.randint(0, 10, args.batch).astype(np.int32)))
  state = sched.init(params, example_batch=batch)
  for _ in range(2 * num_stages + 1):
    state, _ = sched.step(state, batch)
  jax.block_until_ready(state["stages"])
  times = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    for _ in range(args.ticks):
      state, _ = sched.step(state, batch)
    jax.block_until_ready(state["stages"])
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  return {"algorithm": algorithm, "num_stages": num_stages, "backward": backward,
          "ticks_per_second": args.ticks / med,
          "spread": (max(times) - min(times)) / med,
          "stash_bytes": sched.stash_bytes(state)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--ticks", type=int, default=300)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--stages", default="1,2,4")
  parser.add_argument("--json", default=None, help="also write the results here")
  args = parser.parse_args(argv)
  rows = []
  print(f"device: {jax.devices()[0].device_kind}; MLP width {args.width}, 8 layers, batch "
        f"{args.batch}; {args.ticks} ticks x {args.repeats} repeats (median)")
  print(f"{'algorithm':>9} {'K':>2} {'backward':>9} {'ticks/s':>9} {'spread':>7}  stash bytes per stage")
  for K in (int(k) for k in args.stages.split(",")):
    for algorithm in ("bp", "ddg", "fdg"):
      for backward in (("stash",) if algorithm == "bp" else ("stash", "recompute")):
        r = measure(algorithm, K, backward, args)
        rows.append(r)
        print(f"{algorithm:>9} {K:>2} {backward:>9} {r['ticks_per_second']:>9.1f} "
              f"{r['spread']:>6.0%}  {r['stash_bytes']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
