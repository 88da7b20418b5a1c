"""Loader throughput of ``fdg_jax.data.BatchIterator`` in images/s.

CIFAR: a synthetic in-memory uint8 source of 50,000 x 32 x 32 x 3 with the cifar10 registry
entry -- exactly what ``load("cifar10")`` holds once the split is decoded into memory -- so
the numbers measure shuffling + gather + pad/crop/flip + normalisation (not PNG decoding,
which happens once at load time). ``tfds.testing.mock_data`` is not used: its examples are
generated per read by Python code whose speed says nothing about the loader.

ImageNet (``--imagenet N``): N synthetic variable-size uint8 images (short side 200-500)
through the per-image random-resized-crop (train) and resize/center-crop (eval) path.

    python -m fdg_jax.bench data [--batch_size 128 256] [--prefetch 0 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from fdg_jax import data


class _ListDataset(data.Dataset):
  """Variable-size images held in a Python list (stands in for an ImageNet source)."""

  def __init__(self, images, labels):
    super().__init__(data.get_spec("imagenet2012"), "synthetic", len(images))
    self.images, self.labels = images, np.asarray(labels, np.int32)

  def read(self, indices):
    return [self.images[i] for i in indices], self.labels[np.asarray(indices)]


def throughput(ds, batch_size: int, num_batches: int, prefetch: int, augment: bool,
               warmup: int) -> float:
  """images/s over ``num_batches`` training batches after ``warmup`` batches."""
  it = data.BatchIterator(ds, batch_size, train=True, seed=0, augment=augment,
                          prefetch=prefetch)
  for _ in range(warmup):
    next(it)
  start = time.perf_counter()
  for _ in range(num_batches):
    batch = next(it)
  elapsed = time.perf_counter() - start
  assert batch["image"].shape == (batch_size,) + ds.image_shape
  it.close()
  return num_batches * batch_size / elapsed


def report(label: str, runs: list[float]) -> None:
  print(f"{label}: median {statistics.median(runs):9,.0f} images/s  "
        f"(min {min(runs):,.0f}, max {max(runs):,.0f}, {len(runs)} runs)", flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m fdg_jax.bench data",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--num_examples", type=int, default=50_000)
  parser.add_argument("--batch_size", type=int, nargs="+", default=[128, 256])
  parser.add_argument("--num_batches", type=int, default=300)
  parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 2])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--imagenet", type=int, default=256,
                      help="number of synthetic ImageNet-like images (0: skip)")
  args = parser.parse_args(argv)

  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (args.num_examples, 32, 32, 3), dtype=np.uint8)
  ds = data.from_arrays(images, rng.integers(0, 10, args.num_examples), like="cifar10")
  print(f"CIFAR-shaped synthetic source: {ds.num_examples} x {ds.image_shape} uint8")
  for augment in (True, False):
    for bs in args.batch_size:
      for prefetch in args.prefetch:
        runs = [throughput(ds, bs, args.num_batches, prefetch, augment, warmup=20)
                for _ in range(args.repeats)]
        report(f"  augment={str(augment):5s} batch_size={bs:4d} prefetch={prefetch}", runs)

  if args.imagenet:
    sizes = rng.integers(200, 501, (args.imagenet, 2))
    big = [rng.integers(0, 256, (h, w * 4 // 3, 3), dtype=np.uint8) for h, w in sizes]
    inet = _ListDataset(big, rng.integers(0, 1000, args.imagenet))
    print(f"ImageNet-like synthetic source: {args.imagenet} images, short side 200-500")
    for augment in (True, False):
      for prefetch in args.prefetch:
        runs = [throughput(inet, 64, args.imagenet // 64, prefetch, augment, warmup=1)
                for _ in range(args.repeats)]
        what = "random-resized crop + flip" if augment else "resize 256 / center crop 224"
        report(f"  {what:28s} batch_size=  64 prefetch={prefetch}", runs)


if __name__ == "__main__":
  main()
