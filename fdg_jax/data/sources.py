"""Random-access datasets: TFDS (read without TensorFlow), sklearn digits, arrays.

A ``Dataset`` is a sized, random-access collection of raw examples:
``ds.read(indices)`` returns the stored uint8 images and int32 labels of those
examples. Everything else (order, batching, augmentation, normalisation) is the
job of ``BatchIterator``.

TFDS datasets are opened with ``tfds.data_source`` (ArrayRecord random access,
no TensorFlow import) and ``download=False``: nothing is ever downloaded. A
dataset that is not prepared in ``data_dir`` raises ``DatasetNotFoundError``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, Sequence

import numpy as np

from fdg_jax.data.registry import DatasetSpec, get_spec

# Fixed split of the sklearn digits (1,797 images): 360 test examples,
# stratified by class, seed 0.
DIGITS_NUM_TEST = 360
DIGITS_SPLIT_SEED = 0


class DatasetNotFoundError(RuntimeError):
  """A TFDS dataset is not prepared (in a random-access format) in data_dir.

  ``str(err)`` is a single line naming the dataset, the directory searched and
  how to prepare it. Attributes: ``name``, ``data_dir``.
  """

  def __init__(self, name: str, data_dir: str, *, wrong_format: bool = False):
    self.name = name
    self.data_dir = data_dir
    if wrong_format:
      what = (f"Dataset '{name}' is prepared in {data_dir} but not in the random-access "
              "ArrayRecord format needed to read it without TensorFlow.")
    else:
      what = f"Dataset '{name}' is not prepared in {data_dir} (no download is attempted)."
    super().__init__(
        f"{what} Prepare it on a connected machine with `tfds build {name} "
        f"--data_dir={data_dir} --file_format=array_record` (or copy an already prepared "
        f"'{name}' folder into {data_dir}), then pass --config.data_dir={data_dir}.")


class Dataset:
  """A sized random-access dataset of raw images and labels.

  Attributes:
    spec: the registry entry (normalisation, augmentation, ...).
    name: dataset name (``spec.name``).
    split: the split this object holds (as asked for, e.g. ``"train"``).
    num_examples: number of examples.
    num_classes: number of classes.
    image_shape: ``(H, W, C)`` of the images a ``BatchIterator`` yields.
  """

  def __init__(self, spec: DatasetSpec, split: str, num_examples: int):
    self.spec = spec
    self.split = split
    self.num_examples = int(num_examples)

  name = property(lambda self: self.spec.name)
  num_classes = property(lambda self: self.spec.num_classes)
  image_shape = property(lambda self: tuple(self.spec.image_shape))

  def __len__(self) -> int:
    return self.num_examples

  def read(self, indices: np.ndarray) -> tuple[Any, np.ndarray]:
    """Returns ``(images, labels)`` of the examples at ``indices`` (int array [n]).

    ``images`` is uint8 ``[n, H, W, C]`` for fixed-size datasets, else a list of n
    uint8 ``[h_i, w_i, C]`` arrays; ``labels`` is int32 ``[n]``. Must be safe to call
    from several threads.
    """
    raise NotImplementedError

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(name={self.name!r}, split={self.split!r}, "
            f"num_examples={self.num_examples}, num_classes={self.num_classes}, "
            f"image_shape={self.image_shape})")


class ArrayDataset(Dataset):
  """A dataset held in memory as numpy arrays.

  Args:
    images: uint8 ``[N, H, W, C]`` raw pixels (``0..spec.pixel_max``).
    labels: integer ``[N]`` in ``[0, spec.num_classes)``.
    spec: registry entry describing normalisation/augmentation of these images.
    split: a name for the split.
  """

  def __init__(self, images: np.ndarray, labels: np.ndarray, spec: DatasetSpec,
               split: str = "train"):
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.dtype != np.uint8:
      raise ValueError(f"images must be uint8, got {images.dtype}")
    if images.ndim != 4 or images.shape[0] != labels.shape[0] or labels.ndim != 1:
      raise ValueError(f"expected images [N,H,W,C] and labels [N], got {images.shape} and "
                       f"{labels.shape}")
    if spec.fixed_size and tuple(images.shape[1:]) != tuple(spec.image_shape):
      raise ValueError(f"images of shape {images.shape[1:]} do not match the "
                       f"{spec.name} spec {spec.image_shape}")
    super().__init__(spec, split, images.shape[0])
    self.images = np.ascontiguousarray(images)
    self.labels = labels.astype(np.int32)

  def read(self, indices):
    """See ``Dataset.read``."""
    indices = np.asarray(indices, dtype=np.int64)
    return self.images[indices], self.labels[indices]


class TfdsDataset(Dataset):
  """A TFDS split read lazily through a ``tfds.data_source`` (per ``read`` call)."""

  def __init__(self, spec: DatasetSpec, split: str, source: Sequence[Any]):
    super().__init__(spec, split, len(source))
    self.source = source

  def _examples(self, indices) -> list[dict]:
    keys = [int(i) for i in indices]
    if not keys:
      return []
    if hasattr(self.source, "__getitems__"):
      return list(self.source.__getitems__(keys))
    return [self.source[k] for k in keys]

  def read(self, indices):
    """See ``Dataset.read``."""
    examples = self._examples(indices)
    labels = np.asarray([int(ex["label"]) for ex in examples], dtype=np.int32)
    images = [_as_hwc_uint8(ex["image"]) for ex in examples]
    if self.spec.fixed_size:
      h, w, c = self.spec.image_shape
      images = (np.stack(images) if images else np.zeros((0, h, w, c), np.uint8))
    return images, labels


def _as_hwc_uint8(image) -> np.ndarray:
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  if image.dtype != np.uint8:
    image = image.astype(np.uint8)
  return image


@functools.lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  d = load_digits()
  images, target = d.images.astype(np.uint8)[..., None], d.target.astype(np.int32)
  images.flags.writeable = False
  target.flags.writeable = False
  return images, target


def digits_split() -> tuple[np.ndarray, np.ndarray]:
  """Fixed stratified split of the 1,797 sklearn digits.

  Returns sorted int64 index arrays ``(train_idx [1437], test_idx [360])``. Each class
  contributes ``floor(count * 360 / 1797)`` test examples, the remaining ones going to the
  classes with the largest fractional parts (ties: lower class first); the examples of a
  class are picked by a permutation from ``np.random.default_rng(0)``. Pure numpy, so the
  split does not depend on the scikit-learn version.
  """
  y = _digits_raw()[1]
  n = y.shape[0]
  classes, counts = np.unique(y, return_counts=True)
  exact = counts * DIGITS_NUM_TEST / n
  take = np.floor(exact).astype(np.int64)
  frac_order = np.lexsort((classes, -(exact - take)))  # largest fraction first
  take[frac_order[:DIGITS_NUM_TEST - take.sum()]] += 1
  rng = np.random.default_rng(DIGITS_SPLIT_SEED)
  test = []
  for c, k in zip(classes, take):
    members = np.flatnonzero(y == c)
    test.append(members[rng.permutation(members.size)[:k]])
  test_idx = np.sort(np.concatenate(test))
  train_idx = np.setdiff1d(np.arange(n), test_idx)
  return train_idx, test_idx


def load_digits_arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
  """Raw sklearn digits of one split: uint8 ``[n, 8, 8, 1]`` in 0..16, int32 ``[n]``."""
  if split not in ("train", "test"):
    raise ValueError(f"digits has splits 'train' and 'test', not {split!r}")
  images, target = _digits_raw()
  train_idx, test_idx = digits_split()
  idx = train_idx if split == "train" else test_idx
  return images[idx], target[idx]


def _import_tfds():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  return tfds


def resolve_data_dir(data_dir: str | os.PathLike | None) -> str:
  """The TFDS data directory actually searched: ``data_dir``, else ``$TFDS_DATA_DIR``,
  else ``~/tensorflow_datasets`` (user-expanded, absolute)."""
  if data_dir is None:
    data_dir = os.environ.get("TFDS_DATA_DIR") or os.path.join("~", "tensorflow_datasets")
  data_dir = os.fspath(data_dir)
  if "://" in data_dir:  # gs://..., other remote file systems
    return data_dir
  return os.path.abspath(os.path.expanduser(data_dir))


def open_tfds_source(name: str, split: str, data_dir: str | os.PathLike | None = None):
  """Opens a prepared TFDS split as a random-access source, without TensorFlow.

  Calls ``tfds.data_source(name, split=split, data_dir=..., download=False)``; never
  downloads. Raises ``DatasetNotFoundError`` when the dataset is not prepared in
  ``data_dir`` (or only in a non-random-access format such as TFRecord).
  """
  tfds = _import_tfds()
  where = resolve_data_dir(data_dir)
  try:
    return tfds.data_source(name, split=split, data_dir=where, download=False, try_gcs=False)
  except Exception as err:  # pylint: disable=broad-except
    try:
      prepared = tfds.builder(name, data_dir=where).is_prepared()
    except Exception:  # pylint: disable=broad-except
      prepared = False
    if not prepared:
      raise DatasetNotFoundError(name, where) from None
    if isinstance(err, NotImplementedError) or "file format" in str(err).lower():
      raise DatasetNotFoundError(name, where, wrong_format=True) from None
    raise


def _read_all(ds: TfdsDataset, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
  """Decodes a whole fixed-size TFDS split into memory (threads over chunks)."""
  starts = range(0, ds.num_examples, chunk)
  workers = max(1, min(8, os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    parts = list(pool.map(
        lambda s: ds.read(np.arange(s, min(s + chunk, ds.num_examples))), starts))
  h, w, c = ds.spec.image_shape
  if not parts:
    return np.zeros((0, h, w, c), np.uint8), np.zeros((0,), np.int32)
  return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def load(name: str, split: str = "train", data_dir: str | os.PathLike | None = None, *,
         cache: bool | None = None) -> Dataset:
  """Loads one split of a registered dataset.

  Args:
    name: a registry name (``list_datasets()``): ``digits``, ``mnist``, ``fashion_mnist``,
      ``cifar10``, ``cifar100``, ``svhn_cropped``, ``stl10``, ``imagenet2012``.
    split: ``"train"`` or ``"test"`` (``"test"`` is ImageNet's ``validation``); any other
      TFDS split string (``"extra"``, ``"train[:10%]"``) is passed through to TFDS.
    data_dir: TFDS data directory (default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
      Ignored for ``digits``.
    cache: decode the whole split into memory now (True) or read/decode per batch (False).
      None: the registry default (True except ImageNet).

  Returns:
    A ``Dataset`` with ``num_examples``, ``num_classes``, ``image_shape``, ``read``.

  Raises:
    DatasetNotFoundError: a TFDS dataset not prepared in ``data_dir``. Nothing is downloaded.
    ValueError: unknown name or split.
  """
  spec = get_spec(name)
  if spec.source == "sklearn":
    images, labels = load_digits_arrays(spec.source_split(split))
    return ArrayDataset(images, labels, spec, split)
  source = open_tfds_source(name, spec.source_split(split), data_dir)
  ds = TfdsDataset(spec, split, source)
  if spec.cache if cache is None else cache:
    if not spec.fixed_size:
      raise ValueError(f"{name} has variable-size images and cannot be cached in memory")
    images, labels = _read_all(ds)
    return ArrayDataset(images, labels, spec, split)
  return ds


def from_arrays(images: np.ndarray, labels: np.ndarray, like: str | DatasetSpec = "cifar10",
                split: str = "train") -> ArrayDataset:
  """Wraps in-memory uint8 ``images [N,H,W,C]`` and ``labels [N]`` as a ``Dataset`` that is
  normalised and augmented like the registered dataset ``like`` (name or spec)."""
  spec = like if isinstance(like, DatasetSpec) else get_spec(like)
  return ArrayDataset(images, labels, spec, split)
