"""What the trainer reads, by dataset name: the seam between the trainer and kinds of data.

Every dataset the trainer can train by name (`--config.dataset=NAME`) is a `TrainerData`
spec here: how to check a config against it, the classes (or vocabulary) the model's head
needs, one example's shape and dtype, and a loader giving the splits and their iterators.
The image datasets of `fdg_jax.data.registry` and the standard library's text corpus are
registered this way; a user adds their own with `register`, with no change to the library:

    import numpy as np, fdg_jax.data as data

    def load(split, config):                 # split: "train" or "test"
      rng = np.random.default_rng(0 if split == "train" else 1)
      images = rng.integers(0, 256, (512, 8, 8, 1), np.uint8)
      labels = (images.mean(axis=(1, 2, 3)) > 127).astype(np.int32)
      return data.from_arrays(images, labels, like="digits", split=split)

    data.register(data.image_dataset("my_images", load, num_classes=2, shape=(8, 8, 1)))
    # then: trainer.train_and_evaluate(config_with(dataset="my_images"), workdir)

`token_dataset` does the same for a token stream (a `fdg_jax.data.text.TextDataset`).
The trainer and its checks only ever ask the spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Splits:
  """A dataset as the trainer uses it: its two splits and how to iterate them."""
  train: Any                         # the training split (sized: `size(train)`)
  test: Any                          # the evaluation split
  make: Callable[..., Any]           # make(split, batch_size, train, feeding) -> iterator
  size: Callable[[Any], int]         # examples (or windows) in a split
  unit: str                          # what size counts, for messages ("training examples")


@dataclasses.dataclass(frozen=True)
class TrainerData:
  """A dataset the trainer trains by name.

  Attributes:
    name: `--config.dataset` value.
    kind: "images" or "tokens" (labels are one per example, or one per position).
    load: load(config, feeding) -> Splits (feeding: this process's rows of each training
      batch, `process_index` and `process_count`).
    num_classes: num_classes(config) -> the model head's width (classes or vocabulary).
    example: example(config) -> (shape, dtype) of one input, without loading the data.
    check: check(config) -> a one-line problem with the config, or None.
    keys: the batch's (input, target) keys.
  """
  name: str
  kind: str
  load: Callable[[Any, dict], Splits]
  num_classes: Callable[[Any], int]
  example: Callable[[Any], tuple[tuple[int, ...], Any]]
  check: Callable[[Any], str | None] = lambda config: None
  keys: tuple[str, str] = ("image", "label")


_REGISTERED: dict[str, TrainerData] = {}


def register(spec: TrainerData, *, replace: bool = False) -> TrainerData:
  """Adds `spec` to the datasets the trainer knows by name (ValueError if the name is taken,
  unless `replace`)."""
  if spec.kind not in ("images", "tokens"):
    raise ValueError(f"kind must be 'images' or 'tokens', got {spec.kind!r}")
  if spec.name in names() and not replace:
    raise ValueError(f"dataset {spec.name!r} is registered already; pass replace=True")
  _REGISTERED[spec.name] = spec
  return spec


def unregister(name: str) -> None:
  """Removes a dataset `register` added."""
  _REGISTERED.pop(name, None)


def names() -> list[str]:
  """Every dataset the trainer trains by name."""
  from fdg_jax.data.registry import list_datasets
  return list_datasets() + [n for n in _REGISTERED if n not in list_datasets()]


def lookup(name: str) -> TrainerData | None:
  """The spec of `name` (a registered one first, then the image registry), or None."""
  if name in _REGISTERED:
    return _REGISTERED[name]
  from fdg_jax.data.registry import list_datasets
  return _builtin_image(name) if name in list_datasets() else None


# ------------------------------------------------------------------------------ images
def _image_splits(train, test, config) -> Splits:
  from fdg_jax.data.iterator import BatchIterator
  workers = config.get("data_workers", 0)

  def make(ds, batch_size, train_mode, feeding):
    return BatchIterator(ds, batch_size, train=train_mode,
                         seed=config.seed if train_mode else 0, drop_remainder=train_mode,
                         workers=workers if train_mode else 0,
                         **(feeding if train_mode else {}))
  return Splits(train, test, make, lambda ds: ds.num_examples, "training examples")


def image_dataset(name: str, load: Callable[[str, Any], Any], *, num_classes: int,
                  shape: tuple[int, ...]) -> TrainerData:
  """A user's image dataset: `load(split, config)` returns a `fdg_jax.data.Dataset` (e.g.
  `fdg_jax.data.from_arrays(images, labels, like=..., split=split)`) for split "train" and
  "test"; `shape` is one image's (H, W, C)."""
  shape = tuple(int(s) for s in shape)

  def loader(config, feeding):
    del feeding
    return _image_splits(load("train", config), load("test", config), config)
  return TrainerData(name, "images", loader, lambda config: int(num_classes),
                     lambda config: (shape, np.float32))


def _builtin_image(name: str) -> TrainerData:
  from fdg_jax.data.registry import get_spec
  spec = get_spec(name)

  def loader(config, feeding):
    del feeding
    import fdg_jax.data as data  # looked up per call: a study may swap `data.load`
    data_dir = config.data_dir or None
    return _image_splits(data.load(name, "train", data_dir), data.load(name, "test", data_dir),
                         config)
  return TrainerData(name, "images", loader, lambda config: spec.num_classes,
                     lambda config: (tuple(spec.image_shape), np.float32))


# ------------------------------------------------------------------------------ tokens
def _seq_len_check(name: str) -> Callable[[Any], str | None]:
  def check(config):
    if "seq_len" not in config:
      return (f"dataset={name} trains a language model, which this config is not made for "
              "(it has no seq_len, model gpt, ...): use --config configs/lm.py")
    if config.get("seq_len", 0) < 2:
      return f"dataset={name} needs --config.seq_len >= 2 (tokens per window)"
    return None
  return check


def _token_splits(train, test, config) -> Splits:
  from fdg_jax.data import text

  def make(ds, batch_size, train_mode, feeding):
    return text.TextIterator(ds, batch_size, train=train_mode, seed=config.seed,
                             **(feeding if train_mode else {}))
  return Splits(train, test, make, lambda ds: ds.num_windows, "windows")


def token_dataset(name: str, load: Callable[[str, Any], Any], *, vocab_size: int
                  ) -> TrainerData:
  """A user's token stream: `load(split, config)` returns a `fdg_jax.data.text.TextDataset`
  of windows of `config.seq_len` tokens for split "train" and "validation" (evaluated
  on)."""
  def loader(config, feeding):
    del feeding
    return _token_splits(load("train", config), load("validation", config), config)
  return TrainerData(name, "tokens", loader, lambda config: int(vocab_size),
                     lambda config: ((config.seq_len,), np.int32), _seq_len_check(name),
                     ("tokens", "targets"))


def _stdlib_text() -> TrainerData:
  def load(split, config):
    from fdg_jax.data import text  # looked up per call: a study may swap `text.load_text`
    return text.load_text(split, seq_len=config.seq_len,
                          max_bytes=config.get("text_max_bytes", 0) or None)
  from fdg_jax.data.text import VOCAB_SIZE
  return token_dataset("stdlib_text", load, vocab_size=VOCAB_SIZE)


TEXT_DATASET = "stdlib_text"  # byte-level corpus of the Python standard library (offline)
register(_stdlib_text())
