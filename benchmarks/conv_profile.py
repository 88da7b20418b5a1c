"""Where ResNet-20's CPU time goes: each of its convolutions, XLA:CPU against PyTorch.

    python benchmarks/conv_profile.py            # ~3 min on 2 cores
    python benchmarks/conv_profile.py --batch_size 64 --repeats 7
    python benchmarks/conv_profile.py --trace /tmp/trace   # also profile the whole step

`benchmarks/torch_cpu.py` times a whole training step (fdg_jax BP K=1 against torch). This
script breaks that step down: for each distinct convolution of ResNet-20 (CIFAR shapes,
batch --batch_size, 3x3 kernels, no bias; how many of it the network has), the forward and
the backward (the input's and the kernel's cotangents; the kernel's alone for the stem),
timed in three contenders, each in a fresh process, the repeats alternating:
- `jax NHWC`: `lax.conv_general_dilated` jitted, NHWC activations and HWIO kernels (the
  layout of fdg_jax's models, as Flax's `nn.Conv`);
- `jax NCHW`: the same with NCHW / OIHW, torch's layout (does XLA:CPU prefer it?);
- `torch`: `torch.nn.functional.conv2d` and `torch.autograd.grad`, NCHW, default threads
  (timed when torch is installed; `pip install torch`, a CPU build is enough).
A second table times the whole training step of the same network (SGD momentum 0.9;
fdg_jax's BP K=1 through `run`, torch's `nn.Sequential`), with and without its BatchNorms
(each replaced by the identity), so that the step splits into BatchNorm, the convolutions
(the sum of the first table) and the rest (ReLU, shortcuts, pooling, head, loss, SGD).
With --trace, fdg_jax's whole step also runs under JAX's profiler, and the time XLA:CPU's
worker threads spend in each kind of thunk (convolutions, layout transposes, fusions) is
printed from the trace. Prints milliseconds per call (median over repeats), the sums
weighted by each convolution's count, and the ratios to torch; writes --out (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # torch_cpu.py, beside this file
import torch_cpu  # noqa: E402

# (name, input H = W, channels in, channels out, stride, how many in ResNet-20)
CONVS = (
    ("stem 3->16 @32", 32, 3, 16, 1, 1),
    ("16->16 @32", 32, 16, 16, 1, 6),
    ("16->32 /2 @32", 32, 16, 32, 2, 1),
    ("32->32 @16", 16, 32, 32, 1, 5),
    ("32->64 /2 @16", 16, 32, 64, 2, 1),
    ("64->64 @8", 8, 64, 64, 1, 5),
)
CONTENDERS = ("jax NHWC", "jax NCHW", "torch")


def _timed(fn, iters: int) -> float:
  """Seconds per call of fn() (which blocks until its result is ready) after 5 untimed (torch
  sets up a convolution's kernels over its first calls of a shape)."""
  for _ in range(5):
    fn()
  t0 = time.perf_counter()
  for _ in range(iters):
    fn()
  return (time.perf_counter() - t0) / iters


def jax_convs(args, layout: str) -> dict:
  import jax
  import jax.numpy as jnp
  from jax import lax
  dims = ("NHWC", "HWIO", "NHWC") if layout == "NHWC" else ("NCHW", "OIHW", "NCHW")
  out = {}
  key = jax.random.PRNGKey(0)
  for name, h, cin, cout, s, _ in CONVS:
    if layout == "NHWC":
      x = jax.random.normal(key, (args.batch_size, h, h, cin))
      w = jax.random.normal(key, (3, 3, cin, cout)) * 0.1
    else:
      x = jax.random.normal(key, (args.batch_size, cin, h, h))
      w = jax.random.normal(key, (cout, cin, 3, 3)) * 0.1

    def conv(x, w, s=s):
      return lax.conv_general_dilated(x, w, (s, s), ((1, 1), (1, 1)), dimension_numbers=dims)

    fwd = jax.jit(conv)
    y = fwd(x, w)
    g = jnp.ones_like(y)
    stem = cin == 3
    bwd = jax.jit(lambda x, w, g, conv=conv, stem=stem: (
        jax.vjp(lambda w: conv(x, w), w)[1](g) if stem else jax.vjp(conv, x, w)[1](g)))
    out[name] = {"forward": _timed(lambda: fwd(x, w).block_until_ready(), args.iters),
                 "backward": _timed(lambda: jax.block_until_ready(bwd(x, w, g)), args.iters)}
  if layout == "NHWC":  # the whole training step, fdg_jax's BP K=1 (torch_cpu.py's contender)
    step_args = argparse.Namespace(batch_size=args.batch_size, batches=8, warmup=4,
                                   ticks_per_call=4)
    step = lambda: torch_cpu.fdg_jax_run(step_args, "bp", 1)["seconds_per_batch"]  # noqa: E731
    out["whole step"] = {"step": step()}
    from fdg_jax.models import resnet
    resnet.batch_norm = lambda *a, **k: (lambda x: x)  # the same network, BatchNorm removed
    out["whole step, no BatchNorm"] = {"step": step()}
  return out


def torch_convs(args) -> dict:
  import torch
  import torch.nn.functional as F
  out = {}
  g0 = torch.Generator().manual_seed(0)
  for name, h, cin, cout, s, _ in CONVS:
    x = torch.randn(args.batch_size, cin, h, h, generator=g0)
    w = (torch.randn(cout, cin, 3, 3, generator=g0) * 0.1)
    stem = cin == 3
    xg = x.clone().requires_grad_(not stem)
    wg = w.clone().requires_grad_(True)

    def fwd():
      with torch.no_grad():
        F.conv2d(x, w, stride=s, padding=1)

    y = F.conv2d(xg, wg, stride=s, padding=1)
    g = torch.ones_like(y)

    def bwd():
      y = F.conv2d(xg, wg, stride=s, padding=1)
      torch.autograd.grad(y, [wg] if stem else [xg, wg], g)

    # bwd includes a forward (autograd needs its graph): the forward's time is taken off
    f, fb = _timed(fwd, args.iters), _timed(bwd, args.iters)
    out[name] = {"forward": f, "backward": max(fb - f, 0.0)}
  step_args = argparse.Namespace(batch_size=args.batch_size, batches=8, warmup=4)
  out["whole step"] = {"step": torch_cpu.torch_bp(step_args)["seconds_per_batch"]}
  make = torch_cpu.torch_resnet20

  def without_batch_norm():  # the same network, every BatchNorm2d an identity
    model = make()
    for module in list(model.modules()):
      for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.BatchNorm2d):
          setattr(module, name, torch.nn.Identity())
    return model

  torch_cpu.torch_resnet20 = without_batch_norm
  out["whole step, no BatchNorm"] = {
      "step": torch_cpu.torch_bp(step_args)["seconds_per_batch"]}
  return out


def trace_step(args) -> None:
  """A profiler trace (JAX's, Python tracing off) of two `run` calls of 4 ticks of fdg_jax's
  ResNet-20 BP K=1, after two untimed ones; written under args.trace."""
  import jax
  sched, state, batches = torch_cpu.resnet20_schedule("bp", 1, args.batch_size, 4)
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  for traced in (False, True):
    with (jax.profiler.trace(args.trace, profiler_options=options) if traced
          else contextlib.nullcontext()):
      for _ in range(2):
        state, m = sched.run(state, batches)
      jax.block_until_ready((state, m))


def thunk_breakdown(trace_dir: str) -> list[tuple[str, float, int]]:
  """(kind, ms, count) of the XLA:CPU thunks the trace's worker threads ran, by kind (the
  thunk's name without its number: transpose_copy_fusion.23 -> transpose_copy_fusion)."""
  import glob
  import gzip
  import re
  path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
  events = json.load(gzip.open(path[-1]))["traceEvents"]
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  ms, count = {}, {}
  for e in events:
    if "dur" not in e or e["name"].startswith(("ThunkExecutor", "end: ")):
      continue
    if not threads.get((e["pid"], e["tid"]), "").startswith("tf_XLAEigen"):
      continue
    kind = re.sub(r"\.\d+$", "", e["name"])
    ms[kind] = ms.get(kind, 0.0) + e["dur"] / 1e3
    count[kind] = count.get(kind, 0) + 1
  return sorted(((k, v, count[k]) for k, v in ms.items()), key=lambda r: -r[1])


def child(args) -> None:
  if args.child == "trace":
    trace_step(args)
    print(json.dumps({}))
    return
  if args.child == "torch":
    res = torch_convs(args)
  else:
    res = jax_convs(args, args.child.split()[1])
  print(json.dumps(res))


def measure(args, contender: str) -> dict | None:
  return torch_cpu.run_child(__file__, ["--child", contender, "--batch_size",
                                        str(args.batch_size), "--iters", str(args.iters),
                                        "--trace", args.trace])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--iters", type=int, default=10, help="calls per timing")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="")
  parser.add_argument("--trace", default="",
                      help="also profile fdg_jax's whole step (JAX's profiler) into this "
                      "directory and print its time by XLA:CPU thunk kind")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    child(args)
    return 0
  breakdown = None
  if args.trace:
    if measure(args, "trace") is not None:
      breakdown = thunk_breakdown(args.trace)
  contenders = list(CONTENDERS)
  try:
    import torch  # noqa: F401
  except ImportError:
    contenders.remove("torch")
    print("PyTorch is not installed: timing XLA:CPU alone (pip install torch; a CPU build is "
          "enough, e.g. pip install torch --index-url https://download.pytorch.org/whl/cpu)")
  runs: dict[str, list[dict]] = {c: [] for c in contenders}
  for r in range(args.repeats):
    for c in contenders:
      res = measure(args, c)
      if res is not None:
        runs[c].append(res)
      print(f"repeat {r}: {c} {'done' if res else 'failed'}", flush=True)
  # median over repeats of each figure, in ms
  med = {c: {row: {part: 1e3 * statistics.median(x[row][part] for x in v)
                   for part in v[0][row]} for row in v[0]}
         for c, v in runs.items() if v}
  have = [c for c in contenders if c in med]
  print(f"\nResNet-20 convolutions, batch {args.batch_size}, ms per call (median of "
        f"{args.repeats}); backward = input's + kernel's cotangents\n")
  head = " | ".join(f"{c} fwd | {c} bwd" for c in have)
  print(f"| convolution | count | {head} |")
  print("|---|---|" + "---|---|" * len(have))
  totals = {c: {"forward": 0.0, "backward": 0.0} for c in have}
  for name, *_, count in CONVS:
    cells = []
    for c in have:
      f, b = med[c][name]["forward"], med[c][name]["backward"]
      totals[c]["forward"] += count * f
      totals[c]["backward"] += count * b
      cells.append(f"{f:.2f} | {b:.2f}")
    print(f"| {name} | {count} | {' | '.join(cells)} |")
  cells = [f"{totals[c]['forward']:.1f} | {totals[c]['backward']:.1f}" for c in have]
  print(f"| all 19, weighted | | {' | '.join(cells)} |")
  print()
  print("| contender | whole step | BatchNorm (whole - without it) | convolutions (the sum "
        "above) | the rest (without BatchNorm - convolutions) |")
  print("|---|---|---|---|---|")
  for c in have:
    conv = totals[c]["forward"] + totals[c]["backward"]
    if "whole step" not in med[c]:
      print(f"| {c} | – | – | {conv:.1f} | – |")
      continue
    step = med[c]["whole step"]["step"]
    bare = med[c]["whole step, no BatchNorm"]["step"]
    pct = lambda v: f"{v:.1f} ({100 * v / step:.0f}%)"  # noqa: E731
    print(f"| {c} | {step:.1f} | {pct(step - bare)} | {pct(conv)} | {pct(bare - conv)} |")
  print("\nms per training step of ResNet-20; the convolutions timed alone, each in its own "
        "program, the steps as whole programs (XLA fuses across layers there)")
  if breakdown:
    total = sum(v for _, v, _ in breakdown)
    print(f"\nfdg_jax's ResNet-20 step under the profiler (8 ticks): XLA:CPU worker threads' time "
          f"by thunk kind, {total:.0f} ms in all\n")
    print("| thunk kind | ms | share | count |")
    print("|---|---|---|---|")
    for kind, v, n in breakdown[:12]:
      print(f"| {kind} | {v:.0f} | {100 * v / total:.1f}% | {n} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "ms_median": med, "runs_s": runs,
                 "thunks_ms": breakdown}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
