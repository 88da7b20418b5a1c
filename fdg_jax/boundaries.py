"""Stage boundaries: the K-1 block indices that split a sequence of blocks into K stages.

Boundaries b_1 < ... < b_{K-1} lie in (0, num_blocks); stage k runs blocks [b_k, b_{k+1})
(b_0 = 0, b_K = num_blocks). Plain integers only, so that both the stage builders
(`fdg_jax.stages.nnx_stages`) and the splitting of a model (`fdg_jax.partition`, which
re-exports these) read them from here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def stage_ranges(bounds: Sequence[int], num_blocks: int) -> list[tuple[int, int]]:
  """[(start, stop)] block ranges of the stages given by `bounds`."""
  edges = [0, *bounds, num_blocks]
  return list(zip(edges[:-1], edges[1:]))


def check_boundaries(bounds, num_stages: int, num_blocks: int) -> list[int]:
  """Validates explicit boundaries; returns them as a list of ints.

  Raises:
    ValueError: wrong count, not integers, out of (0, num_blocks) or not strictly increasing.
  """
  check_num_stages(num_stages, num_blocks)
  try:
    out = [int(b) for b in bounds]
  except (TypeError, ValueError):
    raise ValueError(f"boundaries must be a list of block indices, got {bounds!r}") from None
  if any(o != b for o, b in zip(out, bounds)):
    raise ValueError(f"boundaries must be integers, got {list(bounds)}")
  if len(out) != num_stages - 1:
    raise ValueError(f"{num_stages} stages need {num_stages - 1} boundaries, got {len(out)}: "
                     f"{out}")
  if any(not 0 < b < num_blocks for b in out):
    raise ValueError(f"boundaries {out} out of range: each must be in 1..{num_blocks - 1} "
                     f"(the model has {num_blocks} blocks)")
  if any(a >= b for a, b in zip(out, out[1:])):
    raise ValueError(f"boundaries {out} must be strictly increasing")
  return out


def check_num_stages(num_stages, num_blocks):
  """ValueError unless 1 <= num_stages <= num_blocks (an integer)."""
  if not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
    raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
  if num_stages > num_blocks:
    raise ValueError(f"cannot split {num_blocks} blocks into {num_stages} stages: at most "
                     f"{num_blocks} stages (one block each)")


def uniform_boundaries(num_blocks: int, num_stages: int) -> list[int]:
  """Equal numbers of blocks per stage, sizes differing by at most one.

  Rounding down puts the extra blocks in the later stages: under FDG the early stages keep the
  longest stashes, so they are the ones to keep small.
  """
  check_num_stages(num_stages, num_blocks)
  return [num_blocks * k // num_stages for k in range(1, num_stages)]
