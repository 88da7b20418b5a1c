"""Loader throughput of ``fdg_jax.data.BatchIterator`` in images/s.

CIFAR: a synthetic in-memory uint8 source of 50,000 x 32 x 32 x 3 with the cifar10 registry
entry -- exactly what ``load("cifar10")`` holds once the split is decoded into memory -- so
the numbers measure shuffling + gather + pad/crop/flip + normalisation (not PNG decoding,
which happens once at load time). ``tfds.testing.mock_data`` is not used: its examples are
generated per read by Python code whose speed says nothing about the loader.

ImageNet (``--imagenet N``): N synthetic variable-size uint8 images (short side 200-500)
through the per-image random-resized-crop (train) and resize/center-crop (eval) path.

ImageNet JPEG (also ``--imagenet N``, and ``--workers``): the same sizes stored as JPEG bytes
(smooth random colour fields plus pixel noise, quality 90, ~70 KB each) and decoded in
``read`` with PIL, as TFDS data sources do; training batches (decode + random-resized crop
+ flip + normalisation) against the number of ``BatchIterator`` worker processes. The
``workers=0`` rows show one thread (prefetch 0) and the default 4 prefetch threads. Each
row also gives the CPU milliseconds per image spent in this process (the training loop's)
and in the workers (Linux): unlike images/s, these do not depend on other jobs' load, and
``free cores / workers' CPU per image`` bounds the images/s.

    python -m fdg_jax.bench data [--batch_size 128 256] [--prefetch 0 2] [--repeats 3]
        [--workers 0 1 2] [--out results.json]

``--num_examples 0`` skips the CIFAR rows, ``--imagenet 0`` the ImageNet ones.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
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
    return [self.images[i] for i in indices], self.labels[np.asarray(indices, np.int64)]


class _JpegDataset(data.Dataset):
  """JPEG-encoded variable-size images decoded per ``read`` with PIL, as a TFDS ImageNet
  data source does (module level, so it pickles to ``BatchIterator`` workers)."""

  def __init__(self, jpegs, labels):
    super().__init__(data.get_spec("imagenet2012"), "synthetic_jpeg", len(jpegs))
    self.jpegs, self.labels = list(jpegs), np.asarray(labels, np.int32)

  def read(self, indices):
    from PIL import Image  # pylint: disable=g-import-not-at-top
    images = []
    for i in indices:
      with Image.open(io.BytesIO(self.jpegs[i])) as image:
        images.append(np.asarray(image))
    return images, self.labels[np.asarray(indices, np.int64)]


def synthetic_image(h: int, w: int, rng: np.random.Generator, cell: int = 12,
                    noise: int = 16) -> np.ndarray:
  """uint8 [h, w, 3]: a random colour field on a ``cell``-pixel grid, bicubically
  upsampled, plus uniform pixel noise of +-``noise`` (JPEG sizes close to photographs,
  unlike white noise)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  low = rng.integers(0, 256, (h // cell + 2, w // cell + 2, 3), dtype=np.uint8)
  image = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), np.int16)
  image = image + rng.integers(-noise, noise + 1, image.shape, dtype=np.int16)
  return np.clip(image, 0, 255).astype(np.uint8)


def synthetic_jpegs(sizes, rng: np.random.Generator, quality: int = 90) -> list[bytes]:
  """JPEG bytes of ``synthetic_image`` for every ``(h, w)`` in ``sizes``."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  out = []
  for h, w in sizes:
    buf = io.BytesIO()
    Image.fromarray(synthetic_image(int(h), int(w), rng)).save(buf, format="JPEG",
                                                                quality=quality)
    out.append(buf.getvalue())
  return out


def _cpu_seconds(pid: int) -> float | None:
  """User + system CPU seconds of process ``pid`` (Linux /proc; None elsewhere)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None


def throughput(ds, batch_size: int, num_batches: int, prefetch: int | None, augment: bool,
               warmup: int, workers: int = 0, cpu: dict | None = None) -> float:
  """images/s over ``num_batches`` training batches after ``warmup`` batches (worker
  start-up happens during the warm-up). ``cpu``: if given, receives the CPU ms per image
  of this process (``"parent"``, all its threads) and of the worker processes
  (``"workers"``, None where unknown) over the timed batches."""
  it = data.BatchIterator(ds, batch_size, train=True, seed=0, augment=augment,
                          prefetch=prefetch, workers=workers)
  try:
    for _ in range(warmup):
      next(it)
    pids = it._procs.pids() if workers else []  # pylint: disable=protected-access
    workers_start = [_cpu_seconds(p) for p in pids]
    cpu_start, start = time.process_time(), time.perf_counter()
    for _ in range(num_batches):
      batch = next(it)
    elapsed = time.perf_counter() - start
    parent_cpu = time.process_time() - cpu_start
    workers_end = [_cpu_seconds(p) for p in pids]
  finally:
    it.close()
  assert batch["image"].shape == (batch_size,) + ds.image_shape
  n = num_batches * batch_size
  if cpu is not None:
    known = None not in workers_start + workers_end
    cpu["parent"] = 1e3 * parent_cpu / n
    cpu["workers"] = (1e3 * (sum(workers_end) - sum(workers_start)) / n if known else None)
  return n / elapsed


def report(label: str, runs: list[float], rows: list | None = None, **fields) -> None:
  print(f"{label}: median {statistics.median(runs):9,.0f} images/s  "
        f"(min {min(runs):,.0f}, max {max(runs):,.0f}, {len(runs)} runs)", flush=True)
  if rows is not None:
    rows.append({**fields, "images_per_s": round(statistics.median(runs), 1),
                 "images_per_s_min": round(min(runs), 1),
                 "images_per_s_max": round(max(runs), 1), "runs": len(runs)})


def _load() -> list[float] | None:
  try:
    return [round(v, 2) for v in os.getloadavg()]
  except OSError:
    return None


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
  parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                      help="BatchIterator worker processes for the ImageNet JPEG rows")
  parser.add_argument("--jpeg_batches", type=int, default=6,
                      help="timed batches of 64 per ImageNet JPEG run (after as many warm-up "
                           "batches as are queued, plus one)")
  parser.add_argument("--out", default=None, help="also write the rows as JSON here")
  args = parser.parse_args(argv)

  rows: list[dict] = []
  load_start = _load()
  rng = np.random.default_rng(0)
  if args.num_examples:
    images = rng.integers(0, 256, (args.num_examples, 32, 32, 3), dtype=np.uint8)
    ds = data.from_arrays(images, rng.integers(0, 10, args.num_examples), like="cifar10")
    print(f"CIFAR-shaped synthetic source: {ds.num_examples} x {ds.image_shape} uint8")
    for augment in (True, False):
      for bs in args.batch_size:
        for prefetch in args.prefetch:
          runs = [throughput(ds, bs, args.num_batches, prefetch, augment, warmup=20)
                  for _ in range(args.repeats)]
          report(f"  augment={str(augment):5s} batch_size={bs:4d} prefetch={prefetch}", runs,
                 rows, source="cifar_memory", augment=augment, batch_size=bs,
                 prefetch=prefetch, workers=0)

  if args.imagenet:
    rng = np.random.default_rng(1)  # the same images whether or not CIFAR ran
    sizes = rng.integers(200, 501, (args.imagenet, 2))
    sizes[:, 1] = sizes[:, 1] * 4 // 3
    labels = rng.integers(0, 1000, args.imagenet)
    big = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    inet = _ListDataset(big, labels)
    print(f"ImageNet-like synthetic source: {args.imagenet} images, short side 200-500")
    for augment in (True, False):
      for prefetch in args.prefetch:
        runs = [throughput(inet, 64, args.imagenet // 64, prefetch, augment, warmup=1)
                for _ in range(args.repeats)]
        what = "random-resized crop + flip" if augment else "resize 256 / center crop 224"
        report(f"  {what:28s} batch_size=  64 prefetch={prefetch}", runs, rows,
               source="imagenet_raw", augment=augment, batch_size=64, prefetch=prefetch,
               workers=0)

    del big
    jpegs = synthetic_jpegs(sizes, rng)
    jpeg_ds = _JpegDataset(jpegs, labels)
    print(f"ImageNet-like JPEG source: {args.imagenet} images, "
          f"{np.mean([len(j) for j in jpegs]) / 1024:.0f} KB mean, decoded per read; "
          f"random-resized crop + flip, batch_size 64, {os.cpu_count()} CPUs")
    configs = [(w, p) for w in args.workers for p in ([0, None] if w == 0 else [None])]
    runs = {c: [] for c in configs}
    cpus = {c: [] for c in configs}
    depths = {(w, p): (0 if p == 0 else 4) if w == 0 else max(4, 2 * w) for w, p in configs}
    for _ in range(args.repeats):  # interleaved: a load change hits every row alike
      for workers, prefetch in configs:
        cpu: dict = {}
        # Warm-up: worker start-up, then past the batches all started at once (timing
        # right after the first batch would count work done during the warm-up).
        runs[workers, prefetch].append(throughput(
            jpeg_ds, 64, args.jpeg_batches, prefetch, True,
            warmup=depths[workers, prefetch] + 1, workers=workers, cpu=cpu))
        cpus[workers, prefetch].append(cpu)
    for workers, prefetch in configs:
      depth = depths[workers, prefetch]
      what = "1 thread" if depth == 0 else (f"{depth} threads" if workers == 0
                                            else f"queue {depth}")
      parent = statistics.median(c["parent"] for c in cpus[workers, prefetch])
      known = [c["workers"] for c in cpus[workers, prefetch] if c["workers"] is not None]
      in_workers = statistics.median(known) if workers and known else None
      report(f"  workers={workers:2d} ({what:10s})", runs[workers, prefetch], rows,
             source="imagenet_jpeg", augment=True, batch_size=64, prefetch=depth,
             workers=workers, parent_cpu_ms_per_image=round(parent, 3),
             workers_cpu_ms_per_image=None if in_workers is None else round(in_workers, 3))
      print(f"      CPU per image: this process {parent:.2f} ms"
            + ("" if in_workers is None else f", workers {in_workers:.2f} ms"), flush=True)

  if args.out:
    meta = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "argv": list(argv) if argv is not None else None, "imagenet": args.imagenet,
            "jpeg_batches": args.jpeg_batches, "repeats": args.repeats,
            "load_average_start_end": [load_start, _load()]}
    with open(args.out, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
