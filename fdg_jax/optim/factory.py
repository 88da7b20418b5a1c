"""The base optimiser by name, and the learning-rate schedules of the papers (optax).

`make_optimizer` builds a stage's plain optimiser from the config's name and parameters:
SGD as the papers' PyTorch code runs it, Adam(W), the library's own (`fdg_jax.optim.adaptive`)
and any optax or optax.contrib optimiser; a staleness remedy is wrapped around it afterwards
(`fdg_jax.optim.methods.stage_optimizer`).

The schedules count optimizer updates. Under DDG/FDG a stage skips its warm-up ticks, so
stage k's schedule runs d_k updates behind the tick counter: a negligible lag (at most
2(K-1) steps) that we accept rather than couple every stage to a global clock.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Callable, Sequence

import optax

from fdg_jax.optim import adaptive


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


# The library's own optimisers, by name (everything else is looked up in optax and
# optax.contrib).
OWN = {"basis_rotation": adaptive.basis_rotation, "nadam_warmup": adaptive.nadam_warmup}


def find_optimizer(name: str) -> Callable:
  """The optimiser factory called `name`: the library's own (`OWN`), then optax's and
  optax.contrib's (any factory whose first parameter is `learning_rate`)."""
  if name in OWN:
    return OWN[name]
  for module in (optax, optax.contrib):
    fn = getattr(module, name, None)
    if callable(fn) and not isinstance(fn, type) and _takes_learning_rate(fn):
      return fn
  raise ValueError(f"unknown optimizer {name!r}; use sgd, adam, {', '.join(sorted(OWN))}, or "
                   "any optax or optax.contrib optimizer (adamw, nadam, lion, muon, ...)")


def _takes_learning_rate(fn) -> bool:
  try:
    params = list(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return False
  return bool(params) and params[0] == "learning_rate"


def optimizer_parameters(name: str) -> tuple[str, ...]:
  """The hyperparameters the optimiser `name` takes besides the learning rate."""
  if name == "sgd":
    return ("momentum", "nesterov", "weight_decay")
  if name == "adam":
    return ("b1", "b2", "eps", "eps_root", "weight_decay")
  params = inspect.signature(find_optimizer(name)).parameters
  return tuple(p for p in params if p != "learning_rate")


def make_optimizer(name: str, learning_rate, *, momentum: float | None = 0.9,
                   nesterov: bool = False, weight_decay: float = 0.0,
                   peak_learning_rate: float | None = None,
                   **hparams) -> optax.GradientTransformation:
  """An optimiser by name, as an optax transform.

  - "sgd": the papers' SGD (+ momentum, + Nesterov) with L2 weight decay added to the
    gradient before momentum (`add_decayed_weights` first), as in PyTorch's SGD that the
    reference codes use; FDG's shrinking is chained before all of it.
  - "adam": Adam, or AdamW (decoupled) when weight_decay > 0.
  - the library's own (`OWN`: basis_rotation, nadam_warmup) and any optax or optax.contrib
    optimiser (adamw, nadam, nadamw, lion, muon, ...). momentum, nesterov and weight_decay
    are passed where the optimiser has a parameter of that name (weight_decay must be 0 for
    one that has none; momentum 0 and nesterov False leave the optimiser's own defaults);
    `hparams` (b1, b2, eps, beta, ...) must each be one of its parameters. ValueError (one
    line) for an unknown name or parameter.

  A second rate among `hparams` (a float parameter named `*_learning_rate`, e.g. muon's
  `adam_learning_rate` for its non-matrix leaves) follows `learning_rate`'s schedule when
  that is one: it is the schedule scaled by value / `peak_learning_rate` (the schedule's
  peak; required then).
  """
  if name == "sgd":
    if hparams:
      raise ValueError(f"optimizer sgd takes momentum, nesterov and weight_decay, not "
                       f"{', '.join(sorted(hparams))}")
    parts = []
    if weight_decay:
      parts.append(optax.add_decayed_weights(weight_decay))
    parts.append(optax.sgd(learning_rate, momentum=momentum or None, nesterov=nesterov))
    return optax.chain(*parts)
  if name == "adam" and not hparams:
    if weight_decay:
      return optax.adamw(learning_rate, weight_decay=weight_decay)
    return optax.adam(learning_rate)
  fn = find_optimizer("adamw" if name == "adam" and weight_decay else name)
  allowed = set(inspect.signature(fn).parameters) - {"learning_rate"}
  unknown = sorted(set(hparams) - allowed)
  if unknown:
    close = [difflib.get_close_matches(u, sorted(allowed), n=1) for u in unknown]
    hint = "".join(f"; did you mean {c[0]} instead of {u}?" for u, c in zip(unknown, close)
                   if c)
    raise ValueError(f"optimizer {name!r} has no parameter {', '.join(unknown)}{hint}; its "
                     f"parameters: {', '.join(sorted(allowed))}")
  kwargs = dict(hparams)
  for key, value in hparams.items():
    if key.endswith("_learning_rate") and callable(learning_rate) and not callable(value):
      if not peak_learning_rate:
        raise ValueError(f"{key} with a learning-rate schedule needs peak_learning_rate")
      ratio = float(value) / float(peak_learning_rate)
      kwargs[key] = lambda count, ratio=ratio: learning_rate(count) * ratio
  if "weight_decay" in allowed:
    kwargs.setdefault("weight_decay", weight_decay)
  elif weight_decay:
    raise ValueError(f"optimizer {name!r} has no weight_decay parameter; set weight_decay=0 "
                     "(or pick its decoupled variant, e.g. adamw)")
  if "momentum" in allowed and momentum:
    kwargs.setdefault("momentum", momentum)
  if "nesterov" in allowed and nesterov:  # else the optimiser's own default (nadam: True)
    kwargs.setdefault("nesterov", True)
  return fn(learning_rate, **kwargs)
