"""grain against fdg_jax's own `BatchIterator`, on the CIFAR training path.

    pip install grain        # not a dependency of fdg_jax
    python benchmarks/grain_loader.py [--num_examples 50000] [--batches 150] [--repeats 3]

The question: could `grain` (deterministic, checkpointable iterators with worker processes;
what MaxText and recent Flax examples use) replace the hand-written pipeline in
`fdg_jax.data`? Both read the same synthetic in-memory uint8 source (50,000 x 32 x 32 x 3,
the cifar10 registry entry) and make the same training batches: an epoch order drawn from a
seed, zero-pad-4 random crops and flips, normalisation to float32, batch 128. Rows, in
alternating rounds (median, min, max images/s):

- `fdg_jax workers=0`: `BatchIterator` in this process (its default prefetch threads).
- `fdg_jax workers=1`: the same batches built in one worker process.
- `grain per-image`: `MapDataset.source → shuffle → random_map(crop, flip, normalise one
  image) → batch`, grain's usual form, iterated in this process.
- `grain per-batch`: the same, but batched first and augmented a whole batch at a time with
  fdg_jax's vectorised crop/flip (the form `BatchIterator` uses), in this process.
- `grain per-batch, 1 worker`: that pipeline behind `mp_prefetch` with one worker process.
- `grain whole batches` (and `, 1 worker`): a grain source whose records are whole batches,
  each gathered at once from a seeded per-epoch permutation (`BatchIterator`'s own method
  inside grain), augmented a batch at a time.

Then, for each library, whether a restored iterator state gives the uninterrupted run's
next batches bit for bit, and the state's size. Each iterator is made afresh per round and
its first `--warmup` batches (worker start-up) are not timed.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time

import numpy as np


def _sources(num_examples: int):
  from fdg_jax import data
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (num_examples, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, num_examples)
  return data.from_arrays(images, labels, like="cifar10"), images, labels


def _fdg_iterator(ds, batch_size: int, workers: int):
  from fdg_jax import data
  return data.BatchIterator(ds, batch_size, train=True, seed=0, augment=True, workers=workers)


def _grain_dataset(images, labels, batch_size: int, per_batch: bool, workers: int,
                   whole_batches: bool = False):
  import grain
  from fdg_jax.data import augment, get_spec
  spec = get_spec("cifar10")
  pad = 4

  def one(record, rng):  # one image and its label; rng: a numpy Generator from grain
    image, label = record["image"], record["label"]
    dy, dx = rng.integers(0, 2 * pad + 1, size=2)
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    crop = padded[dy:dy + 32, dx:dx + 32]
    if rng.random() < 0.5:
      crop = crop[:, ::-1]
    return {"image": augment.normalize(crop, spec), "label": np.int32(label)}

  def whole(batch, rng):
    n = len(batch["label"])
    dy, dx, flip = augment.sample_crop_flip(rng, n, pad, True)
    return {"image": augment.normalize(augment.crop_flip(batch["image"], dy, dx, flip, pad),
                                       spec), "label": batch["label"].astype(np.int32)}

  if whole_batches:
    ds = grain.MapDataset.source(_Batches(images, labels, batch_size)).random_map(whole, seed=1)
    it_ds = ds.to_iter_dataset()
    return it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) if workers \
        else it_ds
  ds = grain.MapDataset.source(_Pairs(images, labels)).shuffle(seed=0).repeat()
  if per_batch:
    ds = ds.batch(batch_size, drop_remainder=True).random_map(whole, seed=1)
  else:
    ds = ds.random_map(one, seed=1).batch(batch_size, drop_remainder=True)
  it_ds = ds.to_iter_dataset()
  if workers:
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return it_ds


class _Pairs:
  """A random-access source of {"image", "label"} records over two arrays (picklable)."""

  def __init__(self, images, labels):
    self.images, self.labels = images, labels

  def __len__(self):
    return len(self.labels)

  def __getitem__(self, i):
    return {"image": self.images[i], "label": self.labels[i]}


class _Batches:
  """Whole training batches as records: record i is step i % steps_per_epoch of epoch
  i // steps_per_epoch, its rows a slice of that epoch's seeded permutation, gathered at
  once (what `BatchIterator` does), for grain to iterate, prefetch and checkpoint."""

  def __init__(self, images, labels, batch_size: int, epochs: int = 1000):
    self.images, self.labels, self.b = images, labels, batch_size
    self.steps = len(labels) // batch_size
    self.epochs = epochs

  def __len__(self):
    return self.steps * self.epochs

  def __getitem__(self, i):
    epoch, step = divmod(int(i), self.steps)
    order = np.random.default_rng((0, epoch)).permutation(len(self.labels))
    rows = np.sort(order[step * self.b:(step + 1) * self.b])
    return {"image": self.images[rows], "label": self.labels[rows]}


def _rate(make, batches: int, warmup: int, batch_size: int) -> float:
  it = make()
  try:
    iterator = iter(it)
    for _ in range(warmup):
      next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
      batch = next(iterator)
    elapsed = time.perf_counter() - start
  finally:
    close = getattr(it, "close", None)
    if close:
      close()
  assert batch["image"].shape == (batch_size, 32, 32, 3), batch["image"].shape
  assert batch["image"].dtype == np.float32
  return batches * batch_size / elapsed


def _fdg_resume(ds, batch_size: int) -> tuple[bool, int]:
  whole = _fdg_iterator(ds, batch_size, 0)
  want = [next(whole)["image"] for _ in range(7)]
  whole.close()
  first = _fdg_iterator(ds, batch_size, 0)
  for _ in range(4):
    next(first)
  state = first.get_state()
  first.close()
  second = _fdg_iterator(ds, batch_size, 0)
  second.set_state(state)
  got = [next(second)["image"] for _ in range(3)]
  second.close()
  return all(np.array_equal(a, b) for a, b in zip(want[4:], got)), len(pickle.dumps(state))


def _grain_resume(images, labels, batch_size: int) -> tuple[bool, int]:
  make = lambda: iter(_grain_dataset(images, labels, batch_size, True, 0))
  whole = make()
  want = [next(whole)["image"] for _ in range(7)]
  first = make()
  for _ in range(4):
    next(first)
  state = first.get_state()
  second = make()
  second.set_state(state)
  got = [next(second)["image"] for _ in range(3)]
  return all(np.array_equal(a, b) for a, b in zip(want[4:], got)), len(pickle.dumps(state))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--num_examples", type=int, default=50_000)
  p.add_argument("--batch_size", type=int, default=128)
  p.add_argument("--batches", type=int, default=150)
  p.add_argument("--warmup", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", help="also write the rows as JSON here")
  args = p.parse_args(argv)
  try:
    import grain
  except ImportError:
    print("error: this benchmark compares with grain: pip install grain", file=sys.stderr)
    return 2
  from absl import flags
  flags.FLAGS.mark_as_parsed()  # grain's workers read its absl flags (their defaults here)
  ds, images, labels = _sources(args.num_examples)
  b = args.batch_size
  rows = {
      "fdg_jax workers=0": lambda: _fdg_iterator(ds, b, 0),
      "fdg_jax workers=1": lambda: _fdg_iterator(ds, b, 1),
      "grain per-image": lambda: _grain_dataset(images, labels, b, False, 0),
      "grain per-batch": lambda: _grain_dataset(images, labels, b, True, 0),
      "grain per-batch, 1 worker": lambda: _grain_dataset(images, labels, b, True, 1),
      "grain whole batches": lambda: _grain_dataset(images, labels, b, True, 0, True),
      "grain whole batches, 1 worker": lambda: _grain_dataset(images, labels, b, True, 1, True),
  }
  import fdg_jax
  print(f"grain {getattr(grain, '__version__', '?')}, fdg_jax {fdg_jax.__version__}; "
        f"{args.num_examples:,} synthetic 32x32x3 uint8 images, batch {b}, {args.batches} "
        f"timed batches after {args.warmup}, {args.repeats} alternating rounds", flush=True)
  runs = {name: [] for name in rows}
  for _ in range(args.repeats):
    for name, make in rows.items():
      runs[name].append(_rate(make, args.batches, args.warmup, b))
  out = []
  base = statistics.median(runs["fdg_jax workers=0"])
  for name, r in runs.items():
    med = statistics.median(r)
    print(f"{name:28s} median {med:9,.0f} images/s (min {min(r):,.0f}, max {max(r):,.0f}); "
          f"{med / base:.2f}x fdg_jax workers=0")
    out.append({"row": name, "images_per_s": med, "min": min(r), "max": max(r)})
  for name, (exact, size) in (("fdg_jax", _fdg_resume(ds, b)),
                              ("grain", _grain_resume(images, labels, b))):
    print(f"{name}: a restored state gives the uninterrupted next batches bitwise: "
          f"{'yes' if exact else 'NO'}; the state pickles to {size} bytes")
    out.append({"row": f"{name} resume", "exact": exact, "state_bytes": size})
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
