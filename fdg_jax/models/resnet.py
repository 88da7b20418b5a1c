"""ResNets as sequences of blocks: CIFAR ResNet-6n+2 (He et al. 2016, Sec. 4.2) and
ResNet-18/34/50/101 with a CIFAR (3x3, stride 1) or ImageNet (7x7 stride 2 + max-pool) stem."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from fdg_jax.models.base import Model
from fdg_jax.models.layers import batch_norm, conv, global_avg_pool, max_pool_3x3_s2

SHORTCUTS = ("A", "B")
STEMS = ("cifar", "imagenet")


class Stem(nn.Module):
  """conv-BN-ReLU; the "imagenet" kind is 7x7 stride 2 followed by a 3x3 stride-2 max-pool."""

  features: int = 16
  kind: str = "cifar"
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    if self.kind == "imagenet":
      x = conv(self.features, 7, 2)(x)
    else:
      x = conv(self.features, 3, 1)(x)
    x = nn.relu(batch_norm(train, self.bn_axis_name)(x))
    if self.kind == "imagenet":
      x = max_pool_3x3_s2(x)
    return x


class BasicBlock(nn.Module):
  """Two 3x3 convs with a residual connection.

  shortcut (when the shape changes): "A" = subsample and zero-pad the channels (no parameters,
  He et al.'s CIFAR option A); "B" = 1x1 conv projection + BN.
  """

  features: int
  strides: int = 1
  shortcut: str = "B"
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    y = conv(self.features, 3, self.strides)(x)
    y = nn.relu(batch_norm(train, self.bn_axis_name)(y))
    y = conv(self.features, 3)(y)
    y = batch_norm(train, self.bn_axis_name)(y)
    return nn.relu(y + self._shortcut(x, train))

  def _shortcut(self, x, train):
    c_in = x.shape[-1]
    if self.strides == 1 and c_in == self.features:
      return x
    if self.shortcut == "A":
      x = x[:, ::self.strides, ::self.strides, :]
      lo = (self.features - c_in) // 2
      return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (lo, self.features - c_in - lo)))
    x = conv(self.features, 1, self.strides, name="shortcut_conv")(x)
    return batch_norm(train, self.bn_axis_name, name="shortcut_bn")(x)


class Bottleneck(nn.Module):
  """1x1 - 3x3 (strided, as torchvision v1.5) - 1x1 with 4x expansion; projection shortcut."""

  features: int
  strides: int = 1
  bn_axis_name: str | None = None
  expansion: int = 4

  @nn.compact
  def __call__(self, x, train: bool):
    out = self.features * self.expansion
    y = nn.relu(batch_norm(train, self.bn_axis_name)(conv(self.features, 1)(x)))
    y = nn.relu(batch_norm(train, self.bn_axis_name)(conv(self.features, 3, self.strides)(y)))
    y = batch_norm(train, self.bn_axis_name)(conv(out, 1)(y))
    if self.strides != 1 or x.shape[-1] != out:
      x = conv(out, 1, self.strides, name="shortcut_conv")(x)
      x = batch_norm(train, self.bn_axis_name, name="shortcut_bn")(x)
    return nn.relu(y + x)


class Head(nn.Module):
  """Global average pool and a dense classifier; `preact` adds the final BN-ReLU of
  pre-activation networks (WRN)."""

  num_classes: int
  preact: bool = False
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    if self.preact:
      x = nn.relu(batch_norm(train, self.bn_axis_name)(x))
    return nn.Dense(self.num_classes)(global_avg_pool(x))


def _check(value, allowed, what):
  if value not in allowed:
    raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(map(str, allowed))}")


def cifar_resnet(depth: int, num_classes: int = 10, *, shortcut: str = "A", width: int = 16,
                 bn_axis_name: str | None = None, name: str | None = None) -> Model:
  """CIFAR ResNet-`depth` (depth = 6n+2): stem, 3 groups of n basic blocks (16, 32, 64), head.

  `width`: the channels of the stem and first group (the published 16); the groups have width,
  2 width and 4 width channels (8 halves every layer's channels, a quarter of the FLOPs).

  Blocks: 0 = stem, 1..n = layer1, n+1..2n = layer2, 2n+1..3n = layer3, 3n+1 = head.
  Option A shortcuts by default: they give the published 0.27M / 0.85M / 1.7M / 19.4M counts
  (option B adds 2,752 parameters and also lands within 1% of them).
  """
  if depth < 8 or (depth - 2) % 6:
    raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1, got {depth}")
  _check(shortcut, SHORTCUTS, "shortcut")
  if not isinstance(width, int) or isinstance(width, bool) or width < 1:
    raise ValueError(f"CIFAR ResNet width must be a positive integer, got {width!r}")
  n = (depth - 2) // 6
  blocks, labels = [Stem(width, "cifar", bn_axis_name)], ["stem"]
  for g, features in enumerate((width, 2 * width, 4 * width)):
    for i in range(n):
      strides = 2 if (g > 0 and i == 0) else 1
      blocks.append(BasicBlock(features, strides, shortcut, bn_axis_name))
      labels.append(f"layer{g + 1}.{i}")
  blocks.append(Head(num_classes, bn_axis_name=bn_axis_name))
  labels.append("head")
  return Model(name=name or f"resnet{depth}", blocks=tuple(blocks), block_names=tuple(labels),
               paper_splits=_cifar_paper_splits(depth, n), num_classes=num_classes)


def _cifar_paper_splits(depth: int, n: int) -> dict:
  """Splits of the FDG reference code (docs/algorithms.md), as block indices.

  layerG[:j] ends at block 1 + (G-1)n + j (block 0 is the stem).
  """
  at = lambda group, j: 1 + (group - 1) * n + j
  return {
      56: {2: (at(2, 4),), 4: (at(1, 6), at(2, 4), at(3, 2))},
      110: {4: (at(1, 13), at(2, 9), at(3, 5))},
  }.get(depth, {})


_IMAGENET_LAYOUTS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)),
                     50: ("bottleneck", (3, 4, 6, 3)), 101: ("bottleneck", (3, 4, 23, 3))}


def resnet(depth: int, num_classes: int = 10, *, stem: str = "cifar",
           bn_axis_name: str | None = None, name: str | None = None) -> Model:
  """ResNet-18/34/50/101 (widths 64-128-256-512, projection shortcuts).

  stem="cifar": 3x3 stride-1 conv, no max-pool (32x32 inputs); stem="imagenet": 7x7 stride 2 +
  max-pool (224x224 inputs). Blocks: stem, each residual block in turn, head.
  """
  if depth not in _IMAGENET_LAYOUTS:
    raise ValueError(f"ResNet depth must be one of {sorted(_IMAGENET_LAYOUTS)}, got {depth}")
  _check(stem, STEMS, "stem")
  kind, counts = _IMAGENET_LAYOUTS[depth]
  blocks, labels = [Stem(64, stem, bn_axis_name)], ["stem"]
  for g, (width, count) in enumerate(zip((64, 128, 256, 512), counts)):
    for i in range(count):
      strides = 2 if (g > 0 and i == 0) else 1
      if kind == "basic":
        blocks.append(BasicBlock(width, strides, "B", bn_axis_name))
      else:
        blocks.append(Bottleneck(width, strides, bn_axis_name))
      labels.append(f"layer{g + 1}.{i}")
  blocks.append(Head(num_classes, bn_axis_name=bn_axis_name))
  labels.append("head")
  input_shape = (224, 224, 3) if stem == "imagenet" else (32, 32, 3)
  return Model(name=name or f"resnet{depth}", blocks=tuple(blocks), block_names=tuple(labels),
               input_shape=input_shape, num_classes=num_classes)
