"""Random-access datasets: TFDS (read without TensorFlow), sklearn digits, arrays.

A ``Dataset`` is a sized, random-access collection of raw examples:
``ds.read(indices)`` returns the stored uint8 images and int32 labels of those
examples. Everything else (order, batching, augmentation, normalisation) is the
job of ``BatchIterator``.

TFDS datasets are opened with ``tfds.data_source`` (ArrayRecord random access,
no TensorFlow import) and ``download=False``: nothing is ever downloaded. A
dataset that is not prepared in ``data_dir`` raises ``DatasetNotFoundError``.

A dataset with original IDX files in the registry (Fashion-MNIST) is read from them
(``load_idx``), looked for in this order: ``data_dir`` (or its ``<name>`` subfolder) holding
them, TFDS's prepared copy in ``data_dir``, the system package's folder
(``/usr/share/datasets/fashion-mnist``, from ``apt-get install dataset-fashion-mnist``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Any, Sequence

import numpy as np

from fdg_jax.data import idx
from fdg_jax.data.registry import DatasetSpec, get_spec

# Fixed split of the sklearn digits (1,797 images): 360 test examples,
# stratified by class, seed 0.
DIGITS_NUM_TEST = 360
DIGITS_SPLIT_SEED = 0


class DatasetNotFoundError(RuntimeError):
  """A dataset is not available: not prepared (in a random-access format) in data_dir, and,
  for a dataset with IDX files (Fashion-MNIST), not installed either.

  ``str(err)`` is a single line naming the dataset, the directory searched and
  how to prepare it. Attributes: ``name``, ``data_dir``, ``wrong_format`` (prepared, but not
  as ArrayRecord).
  """

  def __init__(self, name: str, data_dir: str, *, wrong_format: bool = False,
               message: str | None = None):
    self.name = name
    self.data_dir = data_dir
    self.wrong_format = wrong_format
    if message is None:
      if wrong_format:
        what = (f"Dataset '{name}' is prepared in {data_dir} but not in the random-access "
                "ArrayRecord format needed to read it without TensorFlow.")
      else:
        what = f"Dataset '{name}' is not prepared in {data_dir} (no download is attempted)."
      message = (f"{what} Prepare it on a connected machine with `tfds build {name} "
                 f"--data_dir={data_dir} --file_format=array_record` (or copy an already "
                 f"prepared '{name}' folder into {data_dir}), then pass "
                 f"--config.data_dir={data_dir}.")
    super().__init__(message)


class DatasetFileError(DatasetNotFoundError):
  """A dataset's file is there but unusable: not gzip or IDX, truncated, a sha256 other than
  the original's, or only half of a split's pair of files.

  A ``DatasetNotFoundError``, so that whatever handles a missing dataset handles it too;
  ``str(err)`` is one line naming the file and the fix. Attributes: ``name``, ``data_dir``
  (the file's folder), ``path``.
  """

  def __init__(self, name: str, path: str, message: str):
    self.path = path
    super().__init__(name, os.path.dirname(path), message=message)


class Dataset:
  """A sized random-access dataset of raw images and labels.

  Attributes:
    spec: the registry entry (normalisation, augmentation, ...).
    name: dataset name (``spec.name``).
    split: the split this object holds (as asked for, e.g. ``"train"``).
    num_examples: number of examples.
    num_classes: number of classes.
    image_shape: ``(H, W, C)`` of the images a ``BatchIterator`` yields.
    origin: the folder of the IDX files the examples were read from, else None.
  """

  origin: str | None = None

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
    data_dir: TFDS data directory (default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``),
      or, for ``fashion_mnist``, a folder holding its original IDX files. Ignored for
      ``digits``.
    cache: decode the whole split into memory now (True) or read/decode per batch (False).
      None: the registry default (True except ImageNet). IDX files are always read whole.

  ``fashion_mnist``'s ``"train"`` and ``"test"`` come from its original IDX files where
  there are some: in ``data_dir`` (or ``data_dir/fashion_mnist``), else TFDS's prepared copy
  in ``data_dir``, else the folder of Debian's ``dataset-fashion-mnist`` package. Every IDX
  file is checked against the original's sha256.

  Returns:
    A ``Dataset`` with ``num_examples``, ``num_classes``, ``image_shape``, ``read``.

  Raises:
    DatasetNotFoundError: a TFDS dataset not prepared in ``data_dir`` (for
      ``fashion_mnist``: nor installed). Nothing is downloaded. Its subclass
      ``DatasetFileError``: an IDX file that is corrupt, truncated or not the original.
    ValueError: unknown name or split.
  """
  spec = get_spec(name)
  if spec.source == "sklearn":
    images, labels = load_digits_arrays(spec.source_split(split))
    return ArrayDataset(images, labels, spec, split)
  if spec.idx is not None and split in spec.idx.files:
    return _load_idx_or_tfds(spec, split, data_dir, cache)
  return _load_tfds(spec, split, data_dir, cache)


def _load_tfds(spec: DatasetSpec, split: str, data_dir, cache: bool | None) -> Dataset:
  source = open_tfds_source(spec.name, spec.source_split(split), data_dir)
  ds = TfdsDataset(spec, split, source)
  if spec.cache if cache is None else cache:
    if not spec.fixed_size:
      raise ValueError(f"{spec.name} has variable-size images and cannot be cached in memory")
    images, labels = _read_all(ds)
    return ArrayDataset(images, labels, spec, split)
  return ds


def _load_idx_or_tfds(spec: DatasetSpec, split: str, data_dir, cache: bool | None) -> Dataset:
  """IDX files in data_dir, else TFDS's copy in data_dir, else the system package's files."""
  user_dirs = []
  if data_dir is not None and "://" not in os.fspath(data_dir):
    root = os.path.abspath(os.path.expanduser(os.fspath(data_dir)))
    if not os.path.isdir(root):  # a typo must not fall through to another copy unnoticed
      what = "is a file, not a folder" if os.path.exists(root) else "does not exist"
      raise DatasetNotFoundError(spec.name, root, message=(
          f"data_dir {root} {what}: give the folder that holds {spec.name}'s IDX files (or "
          f"its TFDS copy), or leave data_dir unset to read {spec.idx.system_dir} "
          f"(`apt-get install {spec.idx.package}`)"))
    user_dirs = [root, os.path.join(root, spec.name)]
  folder = find_idx_dir(spec, user_dirs)
  if folder is not None:
    return load_idx(spec, split, folder)
  try:
    return _load_tfds(spec, split, data_dir, cache)
  except (DatasetNotFoundError, ImportError) as err:
    tfds_error = err
  folder = find_idx_dir(spec, [spec.idx.system_dir])
  if folder is not None:
    return load_idx(spec, split, folder)
  raise DatasetNotFoundError(spec.name, resolve_data_dir(data_dir), message=_idx_missing(
      spec, resolve_data_dir(data_dir), user_dirs, tfds_error)) from None


def _idx_missing(spec: DatasetSpec, where: str, user_dirs: list[str], tfds_error) -> str:
  """The one-line message when neither IDX files nor a TFDS copy are there."""
  files = spec.idx.names()
  install = f"`apt-get install {spec.idx.package}`"
  if getattr(tfds_error, "wrong_format", False):
    return (f"{tfds_error} Or install its original IDX files with {install} (into "
            f"{spec.idx.system_dir}).")
  folders = " or ".join(user_dirs + [spec.idx.system_dir])
  return (f"Dataset '{spec.name}' was not found: no IDX files in {folders}, no TFDS copy "
          f"prepared in {where} (no download is attempted). "
          f"Install it with {install}, or pass --config.data_dir=DIR with DIR holding its "
          f"original IDX files ({', '.join(files)}) or a TFDS copy (`tfds build {spec.name} "
          f"--data_dir=DIR --file_format=array_record` on a connected machine).")


def find_idx_dir(spec: DatasetSpec, folders: Sequence[str]) -> str | None:
  """The first of ``folders`` holding any of ``spec``'s IDX files (by name), else None."""
  for folder in folders:
    if any(os.path.isfile(os.path.join(folder, n)) for n in spec.idx.names()):
      return folder
  return None


def load_idx(spec: DatasetSpec, split: str, folder: str | os.PathLike) -> ArrayDataset:
  """Reads ``split`` (``"train"``/``"test"``) of ``spec``'s original IDX files in ``folder``.

  Each file named in ``spec.idx.sha256`` is checked against it; the images must be uint8
  ``[N, H, W, C]`` of the spec's image shape (``[N, H, W]`` when C = 1), the labels uint8 ``[N]``
  in ``[0, num_classes)``. Raises ``DatasetFileError`` (one line) otherwise or when a file
  of the split is missing from ``folder``.
  """
  folder = os.fspath(folder)
  if split not in spec.idx.files:
    raise ValueError(f"{spec.name}'s IDX files have splits {', '.join(spec.idx.files)}, "
                     f"not {split!r}")
  paths = [os.path.join(folder, n) for n in spec.idx.files[split]]
  for path in paths:
    if not os.path.isfile(path):
      raise DatasetFileError(spec.name, path, (
          f"{folder} holds some of {spec.name}'s IDX files but not {os.path.basename(path)}; "
          f"put all of {', '.join(spec.idx.names())} there (`apt-get install "
          f"{spec.idx.package}` installs them in {spec.idx.system_dir})"))
  images, labels = (_read_idx_checked(spec, p) for p in paths)
  h, w, c = spec.image_shape
  want = (h, w) if c == 1 else (h, w, c)
  if images.dtype != np.uint8 or tuple(images.shape[1:]) not in (want, (h, w, c)):
    raise DatasetFileError(spec.name, paths[0], (
        f"{paths[0]}: {images.dtype.name} images of shape {images.shape[1:]}, expected uint8 "
        f"{want}: not {spec.name}'s images"))
  images = images.reshape((-1, h, w, c))
  if labels.dtype != np.uint8 or labels.ndim != 1 or labels.shape[0] != images.shape[0]:
    raise DatasetFileError(spec.name, paths[1], (
        f"{paths[1]}: {labels.dtype.name} labels of shape {labels.shape}, expected uint8 "
        f"[{images.shape[0]}] (one per image of {os.path.basename(paths[0])})"))
  if labels.size and int(labels.max()) >= spec.num_classes:
    raise DatasetFileError(spec.name, paths[1], (
        f"{paths[1]}: label {int(labels.max())} out of range [0, {spec.num_classes}): not "
        f"{spec.name}'s labels"))
  ds = ArrayDataset(images, labels, spec, split)
  ds.origin = folder
  return ds


def _read_idx_checked(spec: DatasetSpec, path: str) -> np.ndarray:
  hint = (f"replace it with the original (`apt-get install {spec.idx.package}` installs it "
          f"in {spec.idx.system_dir}) or remove it from {os.path.dirname(path)}")
  try:
    return idx.read_idx(path, spec.idx.sha256.get(os.path.basename(path)), hint)
  except idx.IdxError as err:
    raise DatasetFileError(spec.name, path, str(err)) from None


def from_arrays(images: np.ndarray, labels: np.ndarray, like: str | DatasetSpec = "cifar10",
                split: str = "train") -> ArrayDataset:
  """Wraps in-memory uint8 ``images [N,H,W,C]`` and ``labels [N]`` as a ``Dataset`` that is
  normalised and augmented like the registered dataset ``like`` (name or spec)."""
  spec = like if isinstance(like, DatasetSpec) else get_spec(like)
  return ArrayDataset(images, labels, spec, split)
