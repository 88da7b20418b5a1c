"""What FDG's stash ring costs per tick, by ablation (one device, the fused engine's `run`).

    python benchmarks/ring_cost.py [--repeats 9] [--ticks 64] [--batch_size 32]

Times, side by side and interleaved (`fdg_jax.bench.timing.time_interleaved`), the
quick-start MLP (4x128, digits' shapes) as BP K=1, BP K=4 and FDG K=4 (`stash`, T = 32 ticks
per call, the platform's default gate: on CPU chained conditionals), FDG K=4 gated by masks
and by conditionals left unchained (`Schedule.gate`, `engines.fused_ops.GatedOps`), and FDG K=4
compiled with parts of the ring's work taken out:

  no ring write        the entry a forward stashes is not written to the ring at all
  unmasked write       written without the warm-up mask (no select against the old slot)
  largest leaf zeroed  written, but the largest leaf of each entry (a Dense layer's weights,
                       which a slot keeps for the delayed backward) replaced by zeros: the
                       same writes, without reading the parameters
  largest leaf unwritten  every leaf of the entry written but that one
  static read          the slot read at offset 0 instead of pops % D
  constants stored     every residual of the vjp stored, the constants too (as before
                       `stages.Residuals`: ReLU's vjp keeps an array of zeros per layer);
                       this variant computes the right gradients

Those variants (not the gates) compute wrong gradients: they exist only to time what each
part of the ring costs; nothing else uses them. Prints µs per sample and the ratio to BP
K=1 (median [min, max] of the per-repetition ratios), the kernels one tick of each compiled
loop runs (`fdg_jax.bench.hlo.loop_kernels`: XLA:CPU runs each as its own kernel; a
conditional counts its largest branch), and the bytes FDG K=4 writes to its stash rings per
tick, weights apart; `--out` also writes them as JSON.
"""

from __future__ import annotations

import os
import argparse
import collections
import contextlib

import numpy as np


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=9)
  p.add_argument("--ticks", type=int, default=64, help="timed ticks per repetition")
  p.add_argument("--run_ticks", type=int, default=32, help="T, ticks per `run` call")
  p.add_argument("--batch_size", type=int, default=32)
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def _no_write(self, k, ring, slot, entry, flag):
  return ring


def _unmasked_write(self, k, ring, slot, entry, flag):
  return ORIGINAL["StageMath.ring_store"](self, k, ring, slot, entry, True)


def _largest_leaf_zeroed(self, k, ring, slot, entry, flag):
  import jax.numpy as jnp
  sizes = [int(np.prod(np.shape(leaf))) for leaf in entry]
  largest = int(np.argmax(sizes))
  entry = tuple(jnp.zeros_like(leaf) if i == largest else leaf for i, leaf in enumerate(entry))
  return ORIGINAL["StageMath.ring_store"](self, k, ring, slot, entry, flag)


def _largest_leaf_unwritten(self, k, ring, slot, entry, flag):
  import jax
  import jax.numpy as jnp
  lay = self.shapes.ring_layouts[k]
  sizes = [int(np.prod(np.shape(leaf))) for leaf in entry]
  largest = int(np.argmax(sizes))
  ring = dict(ring)
  for name, idx in lay.groups:  # `Layout.write`, one leaf left out
    for i in idx:
      if i == largest:
        continue
      start = (slot * lay.sizes[name] + lay.offsets[i],)
      new = jnp.ravel(entry[i]).astype(ring[name].dtype)
      new = jnp.where(flag, new, jax.lax.dynamic_slice(ring[name], start, new.shape))
      ring[name] = jax.lax.dynamic_update_slice(ring[name], new, start)
  return ring


def _constants_stored(self, k, a_spec, math):
  import jax
  from fdg_jax.stages import Residuals
  entry, residuals, h = ORIGINAL["Shapes.entry_and_output"](self, k, a_spec, math)
  if residuals is None or not residuals.fills:
    return entry, residuals, h
  fills, rest, full = {i: (shape, dtype) for i, shape, dtype, _ in residuals.fills}, \
      iter(entry), []
  for i in range(residuals.treedef.num_leaves):
    full.append(jax.ShapeDtypeStruct(*fills[i]) if i in fills else next(rest))
  return tuple(full), Residuals(residuals.treedef), h


def _static_read(self, k, ring, slot):
  import jax.numpy as jnp
  # slot 0 (slot >= 0), still computed from the slot: with chained conditionals (the CPU
  # default) the read keeps its place in the chain (`GatedOps`)
  return ORIGINAL["StageMath.ring_load"](self, k, ring, jnp.minimum(slot, 0))


def _unchained(self, value):
  return value


ORIGINAL: dict = {}
GATES = {
    "FDG K=4, masks": ({"gate": "mask"}, {}),
    "FDG K=4, conditionals unchained": ({"gate": "cond"}, {"GatedOps._chained": _unchained}),
}
VARIANTS = {
    "no ring write": {"StageMath.ring_store": _no_write},
    "unmasked write": {"StageMath.ring_store": _unmasked_write},
    "largest leaf zeroed": {"StageMath.ring_store": _largest_leaf_zeroed},
    "largest leaf unwritten": {"StageMath.ring_store": _largest_leaf_unwritten},
    "static read": {"StageMath.ring_load": _static_read},
    "constants stored": {"Shapes.entry_and_output": _constants_stored},
}


def loop_kernels(entry) -> "collections.Counter":
  """Kernels per tick of a prepared entry's compiled `run` loop (traced again here, so call
  it while the entry's variant is patched in)."""
  from fdg_jax.bench import hlo
  from fdg_jax.ring import without_heads as _without_heads
  schedule, state = entry["schedule"], entry["state"]
  xs, ys = entry["stacked"]
  T = entry["run_ticks"]
  packed, heads = _without_heads(state["stages"])
  text = schedule.engine_impl.program(T).jitted.lower(
      packed, heads, state["inbox"], xs, ys, np.int32(0), np.int32(T)).compile().as_text()
  return hlo.loop_kernels(text)


def stash_written(schedule, params) -> dict:
  """Bytes each stage's forward writes to its stash ring per tick (one entry), and how many
  of them are weights: entry leaves shaped like one of the stage's parameters (rank >= 2)."""
  import jax
  per_stage, weights = [], 0
  for k, lay in enumerate(schedule.shapes.ring_layouts):
    if lay is None or schedule.ring_sizes[k] < 2:
      per_stage.append(0)
      continue
    shapes = {tuple(np.shape(p)) for p in jax.tree.leaves(params[k]) if np.ndim(p) >= 2}
    sizes = [int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(lay.shapes, lay.dtypes)]
    per_stage.append(sum(sizes))
    weights += sum(b for b, s in zip(sizes, lay.shapes) if tuple(s) in shapes)
  return {"total": sum(per_stage), "weights": weights, "per_stage": per_stage}


@contextlib.contextmanager
def patched(methods: dict):
  """The classes' methods named "Class.method" in `methods` (StageMath, Shapes, GatedOps)
  replaced while a schedule is built and compiled."""
  from fdg_jax.engines.fused_ops import GatedOps
  from fdg_jax.shapes import Shapes
  from fdg_jax.stage_math import StageMath
  classes = {"StageMath": StageMath, "Shapes": Shapes, "GatedOps": GatedOps}
  where = lambda name: (classes[name.split(".")[0]], name.split(".")[1])
  for name in ("StageMath.ring_store", "StageMath.ring_load", "Shapes.entry_and_output",
               "GatedOps._chained", *methods):
    ORIGINAL.setdefault(name, getattr(*where(name)))
  try:
    for name, fn in methods.items():
      setattr(*where(name), fn)
    yield
  finally:
    for name, fn in ORIGINAL.items():
      setattr(*where(name), fn)


def main(argv=None) -> dict:
  from fdg_jax.runtime import compile_cache
  compile_cache.enable(os.environ.get("FDG_JAX_COMPILATION_CACHE", "auto"))
  args = parse_args(argv)
  from fdg_jax.bench import common as B, timing
  model = B.build_model("mlp", {"widths": [128] * 4}, (8, 8, 1))
  one, four = (B.build_stages(model, K, "uniform", args.batch_size)[1:] for K in (1, 4))
  batch = B.random_batch(model, args.batch_size)
  configs = [("BP K=1", "bp", one, {}, {}), ("BP K=4", "bp", four, {}, {}),
             ("FDG K=4", "fdg", four, {}, {})]
  configs += [(name, "fdg", four, methods, kwargs)
              for name, (kwargs, methods) in GATES.items()]
  configs += [(f"FDG K=4, {name}", "fdg", four, methods, {})
              for name, methods in VARIANTS.items()]
  entries, kernels = [], []
  for _, algorithm, (stages, params, states), methods, kwargs in configs:
    with patched(methods):  # compiled here, so the program keeps the variant
      entries.append(timing.prepare(B.make_schedule(algorithm, stages, **kwargs), params,
                                    states, batch, run_ticks=args.run_ticks))
      kernels.append(loop_kernels(entries[-1]))
  times = timing.time_interleaved(entries, ticks=args.ticks, repeats=args.repeats)
  base = np.asarray(times[0]["step"])
  rows = []
  print(f"quick-start MLP, batch {args.batch_size}, run T={args.run_ticks}, "
        f"{args.repeats} interleaved repetitions of {args.ticks} ticks")
  print(f"{'configuration':34s} {'µs/sample':>9s}  {'× BP K=1, median [min, max]':28s} "
        "kernels per tick")
  for (name, algorithm, *_), entry, t, kern in zip(configs, entries, times, kernels):
    step = np.asarray(t["step"])
    ratio = step / base
    rows.append({"configuration": name, "us_per_sample": 1e6 * float(np.median(step))
                 / args.batch_size, "ratio": [float(np.median(ratio)), float(ratio.min()),
                                              float(ratio.max())],
                 "kernels_per_tick": dict(kern),
                 "gate": entry["schedule"].gate if algorithm != "bp" else None})
    print(f"{name:34s} {rows[-1]['us_per_sample']:9.2f}  {rows[-1]['ratio'][0]:.3f} "
          f"[{ratio.min():.3f}, {ratio.max():.3f}]{'':8s} {sum(kern.values()):4d}")
  fdg = entries[2]["schedule"]
  stash = stash_written(fdg, four[1])
  print(f"FDG K=4 writes {stash['total'] / 1024:.1f} KiB of stash per tick, "
        f"{stash['weights'] / 1024:.1f} KiB of it weights (the weights each forward used); "
        f"per stage {[round(b / 1024, 1) for b in stash['per_stage']]} KiB")
  return B.write_figures({"args": vars(args), "device": B.device_info(), "rows": rows,
                          "stash_bytes_per_tick": stash}, args.out)


if __name__ == "__main__":
  main()
