"""Small models for tests and examples: an MLP and a CNN, one block per layer."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn

from fdg_jax.models.base import Model


def _flat(x):
  return x.reshape(x.shape[0], -1)


class DenseBlock(nn.Module):
  """Flatten (if needed), dense, ReLU."""

  features: int

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    return nn.relu(nn.Dense(self.features)(_flat(x)))


class DenseHead(nn.Module):
  """Flatten (if needed) and a dense classifier."""

  num_classes: int

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    return nn.Dense(self.num_classes)(_flat(x))


class ConvPoolBlock(nn.Module):
  """3x3 conv, ReLU, 2x2 max-pool."""

  features: int

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    x = nn.relu(nn.Conv(self.features, (3, 3), padding="SAME")(x))
    return nn.max_pool(x, (2, 2), strides=(2, 2))


def mlp(num_classes: int = 10, *, widths: Sequence[int] = (256, 256),
        input_shape: Sequence[int] = (32, 32, 3), name: str = "mlp") -> Model:
  """Dense-ReLU blocks of the given widths, then a dense head (inputs are flattened)."""
  widths = tuple(int(w) for w in widths)
  blocks = [DenseBlock(w) for w in widths] + [DenseHead(num_classes)]
  labels = [f"dense{i}" for i in range(len(widths))] + ["head"]
  return Model(name=name, blocks=tuple(blocks), block_names=tuple(labels),
               input_shape=tuple(input_shape), num_classes=num_classes)


def cnn(num_classes: int = 10, *, channels: Sequence[int] = (32, 64), hidden: int = 128,
        input_shape: Sequence[int] = (32, 32, 3), name: str = "cnn") -> Model:
  """Conv-ReLU-pool blocks, one dense-ReLU block of width `hidden`, a dense head."""
  channels = tuple(int(c) for c in channels)
  blocks = [ConvPoolBlock(c) for c in channels] + [DenseBlock(hidden), DenseHead(num_classes)]
  labels = [f"conv{i}" for i in range(len(channels))] + ["dense", "head"]
  return Model(name=name, blocks=tuple(blocks), block_names=tuple(labels),
               input_shape=tuple(input_shape), num_classes=num_classes)
