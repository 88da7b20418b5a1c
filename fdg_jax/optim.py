"""Optimisers and learning-rate schedules of the papers, as optax transforms.

The schedules count optimizer updates. Under DDG/FDG a stage skips its warm-up ticks, so
stage k's schedule runs d_k updates behind the tick counter: a negligible lag (at most
2(K-1) steps) that we accept rather than couple every stage to a global clock.
"""

from __future__ import annotations

from typing import Sequence

import optax


def learning_rate_schedule(name: str, base_lr: float, *, steps_per_epoch: int, num_epochs: int,
                           warmup_epochs: float = 0.0, milestones: Sequence[float] = (),
                           gamma: float = 0.1) -> optax.Schedule:
  """A per-step learning rate.

  Args:
    name: "constant", "multistep" (lr * gamma**i after the i-th milestone epoch, as in the
      papers: 150, 225, 275 of 300) or "cosine" (to 0 at the end).
    base_lr: the peak learning rate.
    steps_per_epoch, num_epochs: the run's length.
    warmup_epochs: linear warm-up from 0 over this many epochs (then the schedule proper).
    milestones: epochs at which "multistep" decays.
  """
  warmup = int(round(warmup_epochs * steps_per_epoch))
  total = max(num_epochs * steps_per_epoch, 1)
  if name == "constant":
    main = optax.constant_schedule(base_lr)
  elif name == "multistep":
    bounds = {int(round(m * steps_per_epoch)) - warmup: gamma for m in milestones}
    main = optax.piecewise_constant_schedule(base_lr, bounds)
  elif name == "cosine":
    main = optax.cosine_decay_schedule(base_lr, max(total - warmup, 1))
  else:
    raise ValueError(f"unknown lr_schedule {name!r}; choose constant, multistep or cosine")
  if warmup <= 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, base_lr, warmup), main], [warmup])


def make_optimizer(name: str, learning_rate, *, momentum: float = 0.9, nesterov: bool = False,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
  """The papers' optimiser: SGD (+ momentum, + Nesterov) with L2 weight decay, or Adam(W).

  Weight decay is added to the gradient before momentum (`add_decayed_weights` first), as in
  PyTorch's SGD that the reference codes use; FDG's shrinking is chained before all of it.
  """
  if name == "sgd":
    parts = []
    if weight_decay:
      parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov))
    return optax.chain(*parts)
  if name == "adam":
    if weight_decay:
      return optax.adamw(learning_rate, weight_decay=weight_decay)
    return optax.adam(learning_rate)
  raise ValueError(f"unknown optimizer {name!r}; choose sgd or adam")
