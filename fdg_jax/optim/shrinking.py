"""Gradient shrinking (Zhuang et al., FDG): `optax.scale` by beta ** (K - 1 - k).

FDG multiplies the cotangent each stage receives by beta before its backward. Backprop is
linear, so the factors compound: stage k's parameter gradient ends up scaled by
beta ** (K - 1 - k) and the last stage's not at all. Only the parameter updates depend on it,
so shrinking is a stateless rescaling of stage k's gradient, placed first in that stage's
optimizer chain (before weight decay and momentum, as in the reference code): exactly what
`optax.scale` of that factor does, so it is that.

Under Adam-like optimizers the rescaling is nearly a no-op: Adam's update is invariant to a
constant scale of the gradient (up to epsilon), so beta only matters for SGD-like optimizers.
"""

from __future__ import annotations

import optax


def shrink_factor(beta: float, stage: int, num_stages: int) -> float:
  """beta ** (num_stages - 1 - stage): the overall scale of stage `stage`'s gradient."""
  if not 0.0 < beta <= 1.0:
    raise ValueError(f"beta must lie in (0, 1], got {beta}")
  if not 0 <= stage < num_stages:
    raise ValueError(f"stage must lie in [0, {num_stages}), got {stage}")
  return float(beta) ** (num_stages - 1 - stage)


def shrink(beta: float, stage: int, num_stages: int) -> optax.GradientTransformation:
  """Scales stage `stage`'s gradient by beta ** (num_stages - 1 - stage): `optax.scale`.

  Chain it first: `optax.chain(shrink(beta, k, K), optax.sgd(...))`.
  """
  # A Python float, as the factor always was: the product keeps the gradient's dtype.
  return optax.scale(shrink_factor(beta, stage, num_stages))
