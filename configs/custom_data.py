"""Your own dataset, trained by name: this config registers one, then trains it.

    python train.py --config configs/custom_data.py
    python train.py --config configs/custom_data.py --config.algorithm=bp --config.num_stages=1

A config file is Python, so it may register datasets (`fdg_jax.data.register`) before it
names one in `dataset`; nothing in the library changes. Here the data are synthetic 8x8
grey images whose label says whether they are bright, made in memory; load your own arrays
(or files) in `load` the same way. `fdg_jax.data.image_dataset` wraps a loader of image
splits, `fdg_jax.data.token_dataset` one of token streams (`fdg_jax.data.text.from_tokens`;
train those with the GPT of configs/lm.py).
"""

import importlib.util
import pathlib

import numpy as np


def _default():
  path = pathlib.Path(__file__).with_name("default.py")
  spec = importlib.util.spec_from_file_location("_fdg_config_default", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def load(split, config):
  """One split of the dataset as a `fdg_jax.data.Dataset` (uint8 images, int labels)."""
  from fdg_jax import data
  rng = np.random.default_rng([config.seed, 0 if split == "train" else 1])
  n = 2048 if split == "train" else 512
  labels = rng.integers(0, 2, n).astype(np.int32)
  images = rng.integers(0, 8, (n, 8, 8, 1)) + 8 * labels[:, None, None, None]
  # Normalised as the digits are (pixels 0..16): `like` lends a registered dataset's
  # normalisation and augmentation.
  return data.from_arrays(images.astype(np.uint8), labels, like="digits", split=split)


def register():
  from fdg_jax import data
  from fdg_jax.data import kinds
  if kinds.lookup("bright_squares") is None:
    data.register(data.image_dataset("bright_squares", load, num_classes=2, shape=(8, 8, 1)))


def get_config(arg: str | None = None):
  del arg
  register()
  c = _default()
  c.dataset = "bright_squares"
  c.num_epochs = 3
  return c
