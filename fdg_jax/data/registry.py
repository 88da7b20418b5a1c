"""The dataset registry: every per-dataset constant lives here and only here.

Each entry says where a dataset comes from, how many classes it has, the
shape of the images the loader yields, the per-channel normalisation
constants, the split names and the training augmentation.

Normalisation is ``(pixel / pixel_max - mean) / std`` per channel, with
``mean``/``std`` given in ``[0, 1]`` pixel units.

Augmentation kinds (applied only when a ``BatchIterator`` augments):

* ``"none"``      -- no augmentation (MNIST, Fashion-MNIST, digits).
* ``"crop_flip"`` -- zero-pad ``pad`` pixels on every side, random crop back to
  the original size, random horizontal flip with probability 1/2
  (CIFAR-10/100, STL-10).
* ``"crop"``      -- pad + random crop, *no* flip. Used for SVHN: house-number
  digits are not mirror-symmetric (a flipped 2 or 5 is not a digit), so the
  flip is left out on purpose.
* ``"imagenet"``  -- train: random-resized crop to 224 (scale (0.08, 1), aspect
  ratio (3/4, 4/3), bilinear) + horizontal flip; eval (and train without
  augmentation): resize the shorter side to 256 and center crop 224.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

AUGMENTATIONS = ("none", "crop_flip", "crop", "imagenet")


@dataclasses.dataclass(frozen=True)
class IdxFiles:
  """The original gzip'd IDX files of a dataset, read without TFDS (``sources.load``).

  Attributes:
    files: canonical split (``"train"``/``"test"``) -> ``(images file, labels file)``.
    sha256: file name -> hex sha256 of the original ``.gz`` file. Every file read under one
      of these names is checked (the originals are byte-identical everywhere).
    system_dir: where the system package installs them.
    package: the Debian package that installs them (``apt-get install PACKAGE``).
  """

  files: Mapping[str, tuple[str, str]]
  sha256: Mapping[str, str]
  system_dir: str
  package: str

  def names(self) -> list[str]:
    """All file names, in split order (images, labels)."""
    return [n for pair in self.files.values() for n in pair]


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """Static description of one dataset (see the module docstring).

  Attributes:
    name: registry name, also the TFDS name for TFDS datasets.
    source: ``"tfds"`` or ``"sklearn"``.
    num_classes: number of classes; labels are in ``[0, num_classes)``.
    image_shape: ``(H, W, C)`` of the images the loader yields.
    mean: per-channel mean in ``[0, 1]`` pixel units (length C).
    std: per-channel standard deviation in ``[0, 1]`` pixel units (length C).
    splits: canonical split (``"train"``/``"test"``) -> source split name.
    augmentation: one of ``AUGMENTATIONS``.
    pad: padding in pixels for the ``crop``/``crop_flip`` augmentations.
    pixel_max: raw pixel value that maps to 1.0 (255 for uint8 images, 16 for
      the sklearn digits).
    cache: default of ``load(..., cache=None)``: decode the whole split into
      memory once (fixed-size datasets) or read and decode per batch.
    fixed_size: whether all stored images have shape ``image_shape``
      (False for ImageNet, whose images have variable sizes).
    idx: the dataset's original IDX files, read in place of TFDS where present
      (Fashion-MNIST), else None.
  """

  name: str
  source: str
  num_classes: int
  image_shape: tuple[int, int, int]
  mean: tuple[float, ...]
  std: tuple[float, ...]
  splits: Mapping[str, str]
  augmentation: str
  pad: int = 4
  pixel_max: float = 255.0
  cache: bool = True
  fixed_size: bool = True
  idx: IdxFiles | None = None

  def source_split(self, split: str) -> str:
    """Maps ``"train"``/``"test"`` to the source split name; other split
    strings (e.g. ``"extra"``, ``"train[:10%]"``) are passed through."""
    return self.splits.get(split, split)


_TT = {"train": "train", "test": "test"}

# Train-split statistics of the sklearn digits after pixel / 16, for the fixed
# stratified split of ``sources.digits_split`` (1,437 train / 360 test, seed 0).
# tests/test_data.py recomputes them.
DIGITS_MEAN = 0.3055308639961726
DIGITS_STD = 0.3761129517283859

# Fashion-MNIST's original files (Zalando Research), as Debian's dataset-fashion-mnist
# installs them (60,000 train / 10,000 test 28x28 uint8 images, labels 0..9).
FASHION_MNIST_IDX = IdxFiles(
    files={"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
           "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")},
    sha256={
        "train-images-idx3-ubyte.gz":
            "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
        "train-labels-idx1-ubyte.gz":
            "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
        "t10k-images-idx3-ubyte.gz":
            "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
        "t10k-labels-idx1-ubyte.gz":
            "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
    },
    system_dir="/usr/share/datasets/fashion-mnist",
    package="dataset-fashion-mnist")

REGISTRY: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec(
            name="digits", source="sklearn", num_classes=10,
            image_shape=(8, 8, 1), mean=(DIGITS_MEAN,), std=(DIGITS_STD,),
            splits=_TT, augmentation="none", pixel_max=16.0),
        DatasetSpec(
            name="mnist", source="tfds", num_classes=10,
            image_shape=(28, 28, 1), mean=(0.1307,), std=(0.3081,),
            splits=_TT, augmentation="none"),
        DatasetSpec(
            name="fashion_mnist", source="tfds", num_classes=10,
            image_shape=(28, 28, 1), mean=(0.2860,), std=(0.3530,),
            splits=_TT, augmentation="none", idx=FASHION_MNIST_IDX),
        DatasetSpec(
            name="cifar10", source="tfds", num_classes=10,
            image_shape=(32, 32, 3), mean=(0.4914, 0.4822, 0.4465),
            std=(0.2470, 0.2435, 0.2616), splits=_TT,
            augmentation="crop_flip"),
        DatasetSpec(
            name="cifar100", source="tfds", num_classes=100,
            image_shape=(32, 32, 3), mean=(0.5071, 0.4865, 0.4409),
            std=(0.2673, 0.2564, 0.2762), splits=_TT,
            augmentation="crop_flip"),
        DatasetSpec(
            name="svhn_cropped", source="tfds", num_classes=10,
            image_shape=(32, 32, 3), mean=(0.4377, 0.4438, 0.4728),
            std=(0.1980, 0.2010, 0.1970), splits=_TT, augmentation="crop"),
        DatasetSpec(
            name="stl10", source="tfds", num_classes=10,
            image_shape=(96, 96, 3), mean=(0.4467, 0.4398, 0.4066),
            std=(0.2603, 0.2566, 0.2713), splits=_TT,
            augmentation="crop_flip"),
        DatasetSpec(
            name="imagenet2012", source="tfds", num_classes=1000,
            image_shape=(224, 224, 3), mean=(0.485, 0.456, 0.406),
            std=(0.229, 0.224, 0.225),
            splits={"train": "train", "test": "validation"},
            augmentation="imagenet", cache=False, fixed_size=False),
    ]
}


def list_datasets() -> list[str]:
  """Names of all registered datasets."""
  return list(REGISTRY)


def get_spec(name: str) -> DatasetSpec:
  """Returns the ``DatasetSpec`` of ``name``; ValueError for unknown names."""
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(
        f"Unknown dataset {name!r}; known: {', '.join(REGISTRY)}") from None
