"""Wide ResNets (Zagoruyko & Komodakis 2016): pre-activation blocks, widths 16k-32k-64k."""

from __future__ import annotations

import flax.linen as nn

from fdg_jax.models.base import Model
from fdg_jax.models.layers import batch_norm, conv
from fdg_jax.models.resnet import Head


class Conv3x3(nn.Module):
  """The WRN stem: a single 3x3 conv (its BN-ReLU is the first block's pre-activation)."""

  features: int = 16

  @nn.compact
  def __call__(self, x, train: bool):
    del train
    return conv(self.features, 3)(x)


class WideBlock(nn.Module):
  """BN-ReLU-conv3x3-(dropout)-BN-ReLU-conv3x3 plus shortcut.

  When the shape changes the shortcut is a 1x1 conv of the *pre-activated* input, as in the
  authors' code.
  """

  features: int
  strides: int = 1
  dropout: float = 0.0
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    o = nn.relu(batch_norm(train, self.bn_axis_name)(x))
    if self.strides == 1 and x.shape[-1] == self.features:
      shortcut = x
    else:
      shortcut = conv(self.features, 1, self.strides, name="shortcut_conv")(o)
    y = conv(self.features, 3, self.strides)(o)
    y = nn.relu(batch_norm(train, self.bn_axis_name)(y))
    if self.dropout > 0:
      y = nn.Dropout(self.dropout, deterministic=not train)(y)
    y = conv(self.features, 3)(y)
    return y + shortcut


def wrn(depth: int = 28, width: int = 10, num_classes: int = 10, *, dropout: float = 0.0,
        bn_axis_name: str | None = None, name: str | None = None) -> Model:
  """WRN-`depth`-`width` (depth = 6n+4). Blocks: conv1, 3 groups of n wide blocks, head
  (BN, ReLU, pool, dense). `dropout` is the rate between the two convs of every block
  (training forwards then need an `rng`)."""
  if depth < 10 or (depth - 4) % 6:
    raise ValueError(f"WRN depth must be 6n+4 with n >= 1, got {depth}")
  if width < 1:
    raise ValueError(f"WRN width must be >= 1, got {width}")
  if not 0.0 <= dropout < 1.0:
    raise ValueError(f"dropout rate must be in [0, 1), got {dropout}")
  n = (depth - 4) // 6
  blocks, labels = [Conv3x3(16)], ["conv1"]
  for g, base in enumerate((16, 32, 64)):
    for i in range(n):
      strides = 2 if (g > 0 and i == 0) else 1
      blocks.append(WideBlock(base * width, strides, dropout, bn_axis_name))
      labels.append(f"layer{g + 1}.{i}")
  blocks.append(Head(num_classes, preact=True, bn_axis_name=bn_axis_name))
  labels.append("head")
  # FDG reference code, K=2: [conv1, layer1, layer2[:2]] | [layer2[2:], layer3, bn, relu, head].
  paper = {2: (1 + n + 2,)} if (depth, width) == (28, 10) else {}
  return Model(name=name or f"wrn{depth}_{width}", blocks=tuple(blocks),
               block_names=tuple(labels), paper_splits=paper, num_classes=num_classes)
