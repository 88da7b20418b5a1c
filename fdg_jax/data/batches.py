"""One batch of an image dataset, as a pure function of ``(seed, epoch, step)``.

The example order of epoch ``e`` is a permutation drawn from ``(seed, e)`` only
(`epoch_permutation`), and the augmentation of the batch at ``(e, step)`` from
``(seed, e, step)`` only (`augment_rng`; parameters are drawn for the whole global batch,
row ``r`` getting the r-th draw); a process reads its rows of each global batch.

`BatchMaker` holds what that function needs besides the position. `BatchIterator`
(``iterator.py``) builds its batches with it in this process, and its worker processes
(``workers.py``) with a pickled copy: both import it from here, so the batches of
``workers=N`` are bitwise those of ``workers=0``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fdg_jax.data import augment as aug
from fdg_jax.data.sources import Dataset

# Domain tags keep the shuffle and augmentation streams independent.
_SHUFFLE_TAG = 0x5348
_AUGMENT_TAG = 0x4155


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  """The example order of ``epoch``: int64 permutation of ``[0, n)`` that depends only on
  ``(seed, epoch, n)``."""
  rng = np.random.default_rng([int(seed) % 2**63, _SHUFFLE_TAG, int(epoch)])
  return rng.permutation(n)


def augment_rng(seed: int, epoch: int, step: int) -> np.random.Generator:
  """The generator of the augmentation parameters of global batch ``(epoch, step)``."""
  return np.random.default_rng([int(seed) % 2**63, _AUGMENT_TAG, int(epoch), int(step)])


def epoch_order(seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
  """Item indices of ``epoch`` in iteration order: `epoch_permutation`, or ``[0, n)``."""
  return epoch_permutation(seed, epoch, n) if shuffle else np.arange(n)


@dataclasses.dataclass
class BatchMaker:
  """Builds this process's batch at any position ``(epoch, step)`` of ``dataset``.

  ``batch_size`` is the global batch, of which this process reads rows
  ``[process_index * local_batch_size, (process_index + 1) * local_batch_size)``; the
  other fields are `BatchIterator`'s of the same names.
  """
  dataset: Dataset
  batch_size: int
  local_batch_size: int
  process_index: int
  seed: int
  augment: bool
  drop_remainder: bool
  shuffle: bool
  _orders: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def order(self, epoch: int) -> np.ndarray:
    """`epoch_order` of ``epoch``, kept for the current and the next epoch."""
    order = self._orders.get(epoch)
    if order is None:
      order = epoch_order(self.seed, epoch, self.dataset.num_examples, self.shuffle)
      if len(self._orders) >= 2:
        self._orders.pop(min(self._orders))
      self._orders[epoch] = order
    return order

  def make(self, epoch: int, step: int, order: np.ndarray,
           out: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The batch at ``(epoch, step)`` of the epoch's ``order``; ``out``: float32
    [b, H, W, C] to write the images into (a worker's shared memory), else a new array."""
    spec = self.dataset.spec
    gb, lb = self.batch_size, self.local_batch_size
    global_idx = order[step * gb:(step + 1) * gb]
    lo = self.process_index * lb
    local_idx = global_idx[lo:lo + lb]
    n_real = local_idx.shape[0]
    images, labels = self.dataset.read(local_idx)
    kind = spec.augmentation
    rng = augment_rng(self.seed, epoch, step) if self.augment and kind != "none" else None
    if kind == "imagenet":
      uniforms = None
      if rng is not None:
        uniforms = aug.sample_rrc_uniforms(rng, gb)[lo:lo + n_real]
      images = aug.imagenet_batch(images, uniforms, spec.image_shape[0])
    elif rng is not None:
      dy, dx, flip = aug.sample_crop_flip(rng, gb, spec.pad, kind == "crop_flip")
      sl = slice(lo, lo + n_real)
      images = aug.crop_flip(images, dy[sl], dx[sl], flip[sl], spec.pad)
    image = np.empty((lb,) + tuple(spec.image_shape), np.float32) if out is None else out
    aug.normalize(images, spec, out=image[:n_real])
    label = np.asarray(labels, np.int32)
    if n_real < lb:
      image[n_real:] = 0.0
      pad_label = np.zeros((lb,), np.int32)
      pad_label[:n_real] = label
      label = pad_label
    batch = {"image": image, "label": label}
    if not self.drop_remainder:
      mask = np.zeros((lb,), np.float32)
      mask[:n_real] = 1.0
      batch["mask"] = mask
    return batch
