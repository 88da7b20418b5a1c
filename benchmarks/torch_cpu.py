"""CPU time per batch: fdg_jax against PyTorch, side by side (ResNet-20, CIFAR shapes).

    python benchmarks/torch_cpu.py                     # ~7 min on 2 cores
    python benchmarks/torch_cpu.py --xla_flags "--xla_cpu_use_onednn=true" --repeats 5
    python benchmarks/torch_cpu.py --bp_only --variants "" "xla_cpu_use_xnnpack=true"

PyTorch is not a dependency of fdg_jax: without it installed this prints how to install it
(`pip install torch`, a CPU build is enough) and times fdg_jax alone.

The workload: ResNet-20 (option-A shortcuts, as `fdg_jax.models.create("resnet20")`), batch
--batch_size of 32x32x3 images, SGD lr 0.1, momentum 0.9, weight decay 5e-4, cross-entropy.
- torch BP: the same network written here in torch.nn (NCHW), one training step per batch,
  torch's default threads;
- torch FDG K=4 (threads): that network split into 4 stages by layer count, trained by FDG in
  the style of the paper's official code (`torch_fdg.py`: one Python thread per stage each
  tick, joined at its end; weight stashing; one SGD per stage), one batch per tick, torch's
  default intra-op threads; its warm-up is at least the pipeline's fill plus one tick (7);
- fdg_jax BP K=1 and FDG K=4 (balanced split): the trainer's path, the fused engine through
  `run` on one CPU device, --ticks_per_call ticks per call.
Each measurement is a fresh process (so they do not share threads or caches); the repeats
alternate between the contenders. Prints seconds per batch, median [min, max], and the ratio
of each figure to torch BP's; writes --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


# ------------------------------------------------------------------------------ contenders
def torch_resnet20():
  """ResNet-20 with option-A shortcuts in torch.nn (NCHW): one nn.Sequential of 15 children,
  the stem's conv, BatchNorm and ReLU, the nine residual blocks, then pooling, flatten and the
  linear head."""
  import torch.nn as nn
  import torch.nn.functional as F

  class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
      super().__init__()
      self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
      self.b1 = nn.BatchNorm2d(c_out)
      self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
      self.b2 = nn.BatchNorm2d(c_out)
      self.stride, self.pad = stride, c_out - c_in

    def forward(self, x):
      y = F.relu(self.b1(self.c1(x)))
      y = self.b2(self.c2(y))
      s = x
      if self.stride != 1 or self.pad:  # option A: subsample, zero-pad the channels
        s = x[:, :, ::self.stride, ::self.stride]
        lo = self.pad // 2
        s = F.pad(s, (0, 0, 0, 0, lo, self.pad - lo))
      return F.relu(y + s)

  layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
  c = 16
  for width, stride in ((16, 1), (32, 2), (64, 2)):
    for i in range(3):
      layers.append(Block(c, width, stride if i == 0 else 1))
      c = width
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
  return nn.Sequential(*layers)


def torch_sgd(params):
  """The benchmark's optimizer in torch: SGD lr 0.1, momentum 0.9, weight decay 5e-4."""
  import torch
  return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)


def torch_timed(args, step, warmup: int) -> float:
  """Seconds per call of step() over args.batches calls, after `warmup` untimed ones; the
  calls train on one fixed random batch of args.batch_size."""
  import torch
  g = torch.Generator().manual_seed(0)
  x = torch.randn(args.batch_size, 3, 32, 32, generator=g)
  y = torch.randint(0, 10, (args.batch_size,), generator=g)
  for _ in range(warmup):
    step(x, y)
  t0 = time.perf_counter()
  for _ in range(args.batches):
    step(x, y)
  return (time.perf_counter() - t0) / args.batches


def torch_bp(args) -> float:
  import torch.nn.functional as F
  model = torch_resnet20()
  opt = torch_sgd(model.parameters())

  def step(x, y):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()

  return torch_timed(args, step, args.warmup)


def torch_fdg_run(args, k: int) -> float:
  """FDG with K=k stages in torch (`torch_fdg.FDG`); the warm-up is at least the pipeline's
  fill, 2(k-1) ticks, plus one."""
  import torch_fdg
  pipe = torch_fdg.FDG(torch_resnet20(), k, torch_sgd)
  return torch_timed(args, pipe.tick, max(args.warmup, 2 * (k - 1) + 1))


def resnet20_schedule(algorithm: str, k: int, batch_size: int, ticks: int):
  """fdg_jax's ResNet-20 at K stages with the benchmark's SGD (lr 0.1, momentum 0.9, weight
  decay 5e-4): (schedule, its initial state, `ticks` batches of random images and labels)."""
  import numpy as np
  import fdg_jax
  from fdg_jax.bench import schedules as B
  from fdg_jax.optim import make_optimizer
  model = B.build_model("resnet20", {}, None)
  _, stages, params, states = B.build_stages(model, k, "balanced", batch_size)
  opt = make_optimizer("sgd", 0.1, momentum=0.9, weight_decay=5e-4)
  sched = fdg_jax.create(algorithm, stages, B.loss_fn, opt)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(ticks, batch_size, 32, 32, 3)).astype(np.float32)
  ys = rng.integers(0, 10, size=(ticks, batch_size)).astype(np.int32)
  return sched, sched.init(params, states), (xs, ys)


def fdg_jax_run(args, algorithm: str, k: int) -> float:
  import jax
  T = args.ticks_per_call
  sched, state, batches = resnet20_schedule(algorithm, k, args.batch_size, T)
  calls = max(1, args.batches // T)
  for _ in range(max(1, args.warmup // T + 1)):
    state, m = sched.run(state, batches)
  jax.block_until_ready((state, m))
  t0 = time.perf_counter()
  for _ in range(calls):
    state, m = sched.run(state, batches)
  jax.block_until_ready((state, m))
  return (time.perf_counter() - t0) / (calls * T)


def run_child(script: str, argv: list[str], env_updates: dict | None = None) -> dict | None:
  """Runs `python script argv` in a fresh process (without the parent's JAX_NUM_CPU_DEVICES)
  and returns the JSON object of its last output line; None, after one line, if it failed."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  env.update(env_updates or {})
  out = subprocess.run([sys.executable, os.path.abspath(script), *argv], capture_output=True,
                       text=True, env=env)
  if out.returncode != 0:
    print(f"{argv[1] if len(argv) > 1 else script}: failed: "
          f"{out.stderr.strip().splitlines()[-1] if out.stderr else ''}")
    return None
  return json.loads(out.stdout.strip().splitlines()[-1])


# name: (library, algorithm, K); the torch ones are timed when torch is installed
CONTENDERS = {"torch BP": ("torch", "bp", 1), "torch FDG K=4 (threads)": ("torch", "fdg", 4),
              "fdg_jax BP K=1": ("fdg_jax", "bp", 1), "fdg_jax FDG K=4": ("fdg_jax", "fdg", 4)}


def child(args) -> None:
  library, algorithm, k = CONTENDERS[args.contender]
  if library == "fdg_jax":
    seconds = fdg_jax_run(args, algorithm, k)
  elif algorithm == "bp":
    seconds = torch_bp(args)
  else:
    seconds = torch_fdg_run(args, k)
  print(json.dumps({"seconds_per_batch": seconds}))


def measure(args, contender: str, xla_flags: str) -> float | None:
  res = run_child(__file__, ["--child", contender, "--batch_size", str(args.batch_size),
                             "--batches", str(args.batches), "--warmup", str(args.warmup),
                             "--ticks_per_call", str(args.ticks_per_call)],
                  {"XLA_FLAGS": xla_flags})
  return None if res is None else res["seconds_per_batch"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--batches", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=4)
  parser.add_argument("--ticks_per_call", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--xla_flags", default=os.environ.get("XLA_FLAGS", ""),
                      help="XLA_FLAGS for the fdg_jax processes")
  parser.add_argument("--variants", nargs="+", default=None,
                      help="several XLA_FLAGS values, each timed as its own fdg_jax contender "
                      "(side by side with the others and torch), each written without its leading "
                      "'--', e.g. xla_cpu_use_xnnpack=true; '' is XLA's defaults")
  parser.add_argument("--bp_only", action="store_true",
                      help="time the BP contenders only (fdg_jax BP K=1 and torch BP)")
  parser.add_argument("--out", default="")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    args.contender = args.child
    child(args)
    return 0
  chosen = {c: lib for c, (lib, alg, _) in CONTENDERS.items() if not args.bp_only or alg == "bp"}
  ours = [c for c, lib in chosen.items() if lib == "fdg_jax"]
  # A variant's flags may be written without their leading "--" (argparse would take
  # "--xla_..." for an option of this script): "xla_cpu_use_xnnpack=true".
  variants = ([" ".join(f if f.startswith("--") else f"--{f}" for f in v.split())
               for v in args.variants] if args.variants is not None else [args.xla_flags])
  contenders = [(c if len(variants) == 1 else f"{c} [{v or 'defaults'}]", c, v)
                for v in variants for c in ours]
  try:
    import torch  # noqa: F401
    contenders[:0] = [(c, c, "") for c, lib in chosen.items() if lib == "torch"]
  except ImportError:
    print("PyTorch is not installed: timing fdg_jax alone (pip install torch; a CPU build is "
          "enough, e.g. pip install torch --index-url https://download.pytorch.org/whl/cpu)")
  times = {label: [] for label, _, _ in contenders}
  for r in range(args.repeats):
    for label, c, flags in contenders:
      s = measure(args, c, flags)
      if s is not None:
        times[label].append(s)
      print(f"repeat {r}: {label}: {s if s is None else f'{s:.4f} s/batch'}", flush=True)
  med = {c: statistics.median(v) for c, v in times.items() if v}
  flags = "" if len(variants) > 1 else f"; XLA_FLAGS={variants[0]!r}"
  print(f"\nResNet-20, batch {args.batch_size}, SGD momentum 0.9{flags}\n")
  print("| contender | s per batch, median [min, max] | × torch BP |")
  print("|---|---|---|")
  for c, v in times.items():
    if not v:
      continue
    ratio = f"{med[c] / med['torch BP']:.2f}" if "torch BP" in med else "–"
    print(f"| {c} | {med[c]:.4f} [{min(v):.4f}, {max(v):.4f}] | {ratio} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "seconds_per_batch": times}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
