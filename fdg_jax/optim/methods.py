"""The staleness methods by name: one registry for the library, the config and the trainer.

Each method (`Method`) is declared once, in `REGISTRY`: its name (a value of
`--config.staleness`), its hyperparameters (`Hparam`: the key in `stage_optimizer`'s
`hparams`, the config field it is read from and the values that field may take), what it
needs of the base optimiser, where it sits when methods combine, and how it wraps the
transform built so far. Three readers, one declaration:

- `stage_optimizer` builds stage k's transform for its delay d_k (the schedule calls it
  through the trainer's factory, or a user directly);
- `config_hparams` reads a config's settings of its method(s), for the trainer;
- `config_problem` is config validation's check of the staleness fields (one line).

A new method is a builder (usually around a remedy of `fdg_jax.optim.remedies`) and one
entry in `REGISTRY`; its config fields go into configs/default.py, with a comment (the
config reference, docs/configs.md, is generated from them).

Combinations ("spike_compensation+weight_prediction") are built inside out, in the order of
`Method.layer`: the update rule (the base, or spike_compensation / nesterov_delay in its
place), then lr_by_delay after it, error_feedback around that (extrapolating the scaled
update), dc before it, discrepancy_correction after it (averaging the update applied), and
weight_prediction around all of it (extrapolating the update the stage really applies).

At delay 0 a stage keeps the plain base optimiser, bitwise, under every method except
nesterov_delay, which keeps its rule (PipeNAG's choice; see `fdg_jax.optim.remedies`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import optax

from fdg_jax.optim import remedies
from fdg_jax.optim.delayed import DelayedTransformation, chain, check_delay, with_forward


class Base(NamedTuple):
  """The stage's plain optimiser (`tx`) and what it was built from: the methods that
  replace its rule, or need a particular one, read these."""
  tx: Any
  optimizer: str
  learning_rate: Any  # a float or an optax schedule
  momentum: float
  nesterov: bool
  weight_decay: float


_KEEP = object()  # an Hparam's default: pass nothing, the remedy's own default applies


def _as_is(value, steps_per_epoch):
  del steps_per_epoch
  return value


def _negative_is_none(value, steps_per_epoch):
  del steps_per_epoch
  return None if value < 0 else value


def _epochs_to_updates(value, steps_per_epoch):
  return None if value < 0 else int(round(value * steps_per_epoch))


def _unit_interval(value) -> bool:
  return 0.0 <= value < 1.0


@dataclasses.dataclass(frozen=True)
class Hparam:
  """One setting of a staleness method.

  Attributes:
    name: its key in `stage_optimizer`'s `hparams`.
    default: its value where `hparams` lacks it (`_KEEP`: the remedy's own default).
    required: `stage_optimizer` refuses to build without it; `note` says what it is.
    field: the trainer config's field it is read from (None: a library setting only), and
      `from_field(value, steps_per_epoch)` the setting a field's value gives.
    valid: the field's admissible values (None: any); `expect` says which, after
      "<field>=<value> " in the error line.
  """
  name: str
  default: Any = _KEEP
  required: bool = False
  note: str = ""
  field: Optional[str] = None
  from_field: Callable[[Any, int], Any] = _as_is
  valid: Optional[Callable[[Any], bool]] = None
  expect: str = ""


def _anything(base: Base) -> None:
  del base
  return None


@dataclasses.dataclass(frozen=True)
class Method:
  """A staleness method.

  Attributes:
    name: the method's name (`--config.staleness`).
    build: `(inner, delay, settings, base) -> DelayedTransformation`, the method wrapped
      around `inner` (the transform built so far) for a stage of delay `delay` >= 1 (and at
      delay 0 where `at_zero_delay`); `settings` are its hparams, defaults filled in.
    layer: its place in a combination, built inside out from 0; `RULE` (0): it replaces the
      base's update rule, and at most one such method combines.
    hparams: its settings.
    at_zero_delay: it acts at delay 0 too (else a stage of delay 0 keeps `inner`).
    requires: `base -> None`, or (what rules the base out, the config setting that fixes it).
    clashes: (another method, why the two do not combine) pairs.
  """
  name: str
  build: Callable[..., DelayedTransformation]
  layer: int
  hparams: tuple[Hparam, ...] = ()
  at_zero_delay: bool = False
  requires: Callable[[Base], Optional[tuple[str, str]]] = _anything
  clashes: tuple[tuple[str, str], ...] = ()

  @property
  def hparam_names(self) -> tuple[str, ...]:
    """The keys of `hparams` the method takes."""
    return tuple(h.name for h in self.hparams)

  def settings(self, hparams: dict) -> dict:
    """Its own entries of `hparams`, with the defaults of those missing."""
    return {h.name: hparams.get(h.name, h.default) for h in self.hparams
            if h.name in hparams or h.default is not _KEEP}


RULE = 0  # the layer of the methods that replace the base's update rule


def _sgd_rule(base: Base) -> Optional[tuple[str, str]]:
  if base.optimizer != "sgd":
    return (f"replaces the SGD rule; it does not apply to optimizer {base.optimizer!r}",
            "--config.optimizer=sgd")
  return None


def _heavy_ball(base: Base) -> Optional[tuple[str, str]]:
  """spike_compensation's derivation: plain SGD with heavy-ball momentum in (0, 1)."""
  not_sgd = _sgd_rule(base)
  if not_sgd:
    return not_sgd
  if base.nesterov:
    return "is derived for heavy-ball SGD momentum, not Nesterov", "--config.nesterov=False"
  if not base.momentum or not 0.0 < base.momentum < 1.0:
    return (f"needs SGD with momentum in (0, 1), got {base.momentum!r}",
            "--config.momentum in (0, 1)")
  return None


def _with_weight_decay(tx, base: Base) -> DelayedTransformation:
  """A rule that replaces the base's, with the base's L2 weight decay added first (as SGD
  adds it in `fdg_jax.optim.make_optimizer`)."""
  if base.weight_decay:
    return chain(optax.add_decayed_weights(base.weight_decay), tx)
  return with_forward(tx)


def _none(inner, delay, settings, base):
  del delay, settings, base
  return inner


def _lr_by_delay(inner, delay, settings, base):
  del base
  return chain(inner, remedies.lr_by_delay(delay, settings["ramp_steps"], settings["power"]))


def _weight_prediction(inner, delay, settings, base):
  del base
  return remedies.weight_prediction(inner, delay, horizon=settings["horizon"])


def _spike_compensation(inner, delay, settings, base):
  del inner, settings  # replaces the rule
  return _with_weight_decay(
      remedies.spike_compensation(base.learning_rate, delay, base.momentum), base)


def _dc(inner, delay, settings, base):
  del base
  return chain(remedies.delay_compensation(delay, **settings), inner)


def _nesterov_delay(inner, delay, settings, base):
  del inner  # replaces the rule
  lr = settings["learning_rate"]
  if lr is None:  # the base's effective step: PyTorch SGDM's eta/(1-m), as PipeNAG's is eta
    scale = 1.0 / (1.0 - (base.momentum or 0.0))
    rate = base.learning_rate
    lr = (lambda count: rate(count) * scale) if callable(rate) else rate * scale
  tx = remedies.nesterov_delay(lr, delay, momentum=settings["gamma"])
  return chain(optax.add_decayed_weights(base.weight_decay), tx) if base.weight_decay else tx


def _error_feedback(inner, delay, settings, base):
  del base
  return remedies.error_feedback(inner, delay, strength=settings["strength"])


def _discrepancy_correction(inner, delay, settings, base):
  del base
  return chain(inner, remedies.discrepancy_correction(delay, settings["discrepancy_decay"]))


_DECAY = dict(valid=_unit_interval, expect="must lie in [0, 1)")

# The order here is METHODS' order (error messages list it); `layer` orders combinations.
REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("none", _none, layer=1),  # the base alone (never part of a combination)
    Method("lr_by_delay", _lr_by_delay, layer=1, hparams=(
        Hparam("ramp_steps", required=True,
               note="T_r, in updates; PipeNAG's code uses 7 epochs",
               field="staleness_ramp_epochs", from_field=_epochs_to_updates),
        Hparam("power", 1.0, field="staleness_lr_power", valid=lambda v: v >= 0,
               expect="must be >= 0 (the rate's exponent: lr * d_k^-power)"))),
    Method("weight_prediction", _weight_prediction, layer=5, hparams=(
        Hparam("horizon", None, field="staleness_horizon", from_field=_negative_is_none),)),
    Method("spike_compensation", _spike_compensation, layer=RULE, requires=_heavy_ball),
    Method("dc", _dc, layer=3, hparams=(
        Hparam("lam", field="dc_lambda"), Hparam("adaptive", field="dc_adaptive"),
        Hparam("decay", field="dc_decay", **_DECAY), Hparam("lam0", field="dc_lambda0"),
        Hparam("eps")),
        clashes=(("weight_prediction", "dc compensates the weights the forward ran at and "
                  "weight_prediction moves them"),)),
    Method("nesterov_delay", _nesterov_delay, layer=RULE, at_zero_delay=True,
           requires=_sgd_rule, hparams=(
               Hparam("gamma", 0.99, field="nesterov_gamma", **_DECAY),
               Hparam("learning_rate", None))),
    Method("error_feedback", _error_feedback, layer=2, hparams=(
        Hparam("strength", 1.0, field="staleness_strength"),)),
    Method("discrepancy_correction", _discrepancy_correction, layer=4, hparams=(
        Hparam("discrepancy_decay", 0.9, field="discrepancy_decay", **_DECAY),)),
)}
METHODS = tuple(REGISTRY)  # the names (the functions below read REGISTRY itself)


def parse_methods(method: str) -> tuple[str, ...]:
  """The methods of a combination "a+b+..." (ValueError: unknown, repeated or clashing)."""
  parts = tuple(m.strip() for m in method.split("+"))
  for m in parts:
    if m not in REGISTRY or m == "none":
      raise ValueError(f"unknown staleness method {m!r} in {method!r}; combine methods of "
                       f"{tuple(n for n in REGISTRY if n != 'none')} with '+'")
  if len(set(parts)) != len(parts):
    raise ValueError(f"staleness {method!r} repeats a method")
  rules = [m for m in REGISTRY if m in parts and REGISTRY[m].layer == RULE]
  if len(rules) > 1:
    raise ValueError(f"{' and '.join(rules)} each replace the SGD rule: combine at most one "
                     "of them")
  for m in parts:
    for other, why in REGISTRY[m].clashes:
      if other in parts:
        raise ValueError(f"{why}: combine at most one of them")
  return parts


def _parts(method: str) -> tuple[str, ...]:
  if "+" in method:
    return parse_methods(method)
  if method not in REGISTRY:
    raise ValueError(f"unknown staleness method {method!r}; choose one of {tuple(REGISTRY)}")
  return (method,)


def stage_optimizer(method: str, base, *, delay: int, learning_rate, momentum: float,
                    weight_decay: float, hparams: Optional[dict] = None, optimizer: str = "sgd",
                    nesterov: bool = False) -> DelayedTransformation:
  """Stage k's optimiser for a staleness method (or "a+b" combination), given the plain base.

  Args:
    method: one of METHODS, or several joined by "+".
    base: the plain optax optimiser of the stage (`fdg_jax.optim.make_optimizer(...)`), built
      from `optimizer`, learning_rate, momentum, nesterov and weight_decay.
    delay: the stage's gradient delay d_k.
    learning_rate, momentum, weight_decay: the base's (float or optax schedule for the rate).
    hparams: the methods' own settings (`REGISTRY[name].hparams`): lr_by_delay {"ramp_steps"}
      (required, T_r in updates), {"power"}; weight_prediction {"horizon"}; dc {"lam",
      "adaptive", "decay", "lam0", "eps"}; nesterov_delay {"gamma" (default 0.99),
      "learning_rate" (default learning_rate/(1-momentum), the base's effective step)};
      error_feedback {"strength"}; discrepancy_correction {"discrepancy_decay"}. Each part of
      a combination takes its own keys; unknown keys raise.
    optimizer, nesterov: the base's kind, for the methods that replace it (spike_compensation
      needs plain heavy-ball SGD with momentum; nesterov_delay an SGD base).

  Returns "none": with_forward(base); at delay 0 with_forward(base) for every method except
  nesterov_delay (which keeps its rule). FDG's shrink goes first:
  `chain(shrink(...), stage_optimizer(...))`.
  """
  parts = _parts(method)
  hparams = dict(hparams or {})
  taken = tuple(h for m in REGISTRY if m in parts for h in REGISTRY[m].hparam_names)
  unknown = sorted(set(hparams) - set(taken))
  if unknown:
    raise ValueError(f"staleness method {method!r} takes hparams {taken}, got unknown "
                     f"{unknown}")
  d = check_delay(delay)
  spec = Base(base, optimizer, learning_rate, momentum, nesterov, weight_decay)
  for name in parts:
    problem = REGISTRY[name].requires(spec)
    if problem:
      raise ValueError(f"staleness method {name!r} {problem[0]}")
    for h in REGISTRY[name].hparams:
      if h.required and h.name not in hparams:
        raise ValueError(f"{name} needs hparams[{h.name!r}] ({h.note})")
  tx = with_forward(base)
  for name in sorted(parts, key=lambda m: REGISTRY[m].layer):
    m = REGISTRY[name]
    if d or m.at_zero_delay:
      tx = m.build(tx, d, m.settings(hparams), spec)
  return tx


# ------------------------------------------------------------------------------ the config
def config_hparams(config, steps_per_epoch: int) -> dict:
  """The `hparams` of the config's staleness method(s) ("a+b" combines them), from the
  config fields the registry names (a field the config lacks: the method's default)."""
  out: dict = {}
  for name in config.get("staleness", "none").split("+"):
    for h in REGISTRY[name].hparams if name in REGISTRY else ():
      if h.field is not None and h.field in config:
        out[h.name] = h.from_field(config[h.field], steps_per_epoch)
  return out


def config_problem(config) -> Optional[str]:
  """What is wrong with the config's staleness fields, in one line (None: nothing).

  The method (`--config.staleness`; "auto" is resolved into one of the others before
  training, `fdg_jax.optim.auto`), what its methods need of the optimiser and the config,
  and the value of every method's config field that has a range (set fields are checked
  whichever method runs).
  """
  method = config.get("staleness", "none")
  if method != "auto":
    if "+" in method:
      try:
        parts = parse_methods(method)
      except ValueError as e:
        return str(e)
    elif method not in REGISTRY:
      return (f"unknown staleness {method!r}; use --config.staleness=auto|"
              f"{'|'.join(REGISTRY)} (or several joined by '+')")
    else:
      parts = (method,)
    base = Base(None, config.optimizer, config.learning_rate, config.momentum,
                config.get("nesterov", False), config.weight_decay)
    for name in parts:
      problem = REGISTRY[name].requires(base)
      if problem:
        return f"staleness={name} {problem[0]}; use {problem[1]}"
      for h in REGISTRY[name].hparams:
        if h.required and h.field is not None and h.field not in config:
          return (f"staleness={name} needs the config field {h.field}; start from "
                  "configs/default.py")
  for m in REGISTRY.values():
    for h in m.hparams:
      if h.field is not None and h.valid is not None and h.field in config \
          and not h.valid(config[h.field]):
        return f"{h.field}={config[h.field]} {h.expect}"
  return None
