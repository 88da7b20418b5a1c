"""The `Model` record and the linen module that runs a contiguous range of its blocks."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class BlockRange(nn.Module):
  """Applies `blocks` in order; block i of the range is named `block_{start + i}`.

  Naming by the *global* block index makes the variables of a stage a sub-dict of the unsplit
  model's variables, whatever the split: params move between splits (or from a checkpoint) by
  key, and a block's dropout stream (derived from its module path) is the same in every split.
  """

  blocks: Sequence[nn.Module]
  start: int = 0

  @nn.compact
  def __call__(self, x, train: bool):
    for i, block in enumerate(self.blocks):
      x = block.clone(name=f"block_{self.start + i}", parent=self)(x, train=train)
    return x


@dataclasses.dataclass(frozen=True)
class Model:
  """A network written as a sequence of blocks; any block boundary can be a stage boundary.

  Attributes:
    name: registry name, e.g. "resnet56".
    blocks: the linen modules, each `__call__(x, train: bool)`, applied in order.
    block_names: a human label per block ("stem", "layer1.0", ..., "head").
    paper_splits: num_stages -> boundaries (block indices where stages 1..K-1 start) used by the
      FDG reference code, where known.
    input_shape: shape of one example (no batch axis), e.g. (32, 32, 3).
    num_classes: output width of the head (the vocabulary size of a language model).
    input_dtype: dtype of the inputs: "float32" (images, features) or "int32" (tokens).
  """

  name: str
  blocks: tuple
  block_names: tuple
  paper_splits: dict = dataclasses.field(default_factory=dict)
  input_shape: tuple = (32, 32, 3)
  num_classes: int = 10
  input_dtype: str = "float32"

  @property
  def num_blocks(self) -> int:
    return len(self.blocks)

  def module(self, start: int = 0, stop: int | None = None) -> BlockRange:
    """The linen module applying blocks[start:stop] (the whole network by default)."""
    stop = self.num_blocks if stop is None else stop
    return BlockRange(blocks=tuple(self.blocks[start:stop]), start=start)

  def example_input(self, batch_size: int = 1, dtype=None) -> jax.ShapeDtypeStruct:
    """A shape-only input of `batch_size` examples (for init, eval_shape and cost analysis);
    its dtype is `input_dtype` unless `dtype` is given."""
    dtype = self.input_dtype if dtype is None else dtype
    return jax.ShapeDtypeStruct((batch_size, *self.input_shape), jnp.dtype(dtype))
