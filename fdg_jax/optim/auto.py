"""`--config.staleness=auto`: the delay-robustness study's choice, and nothing beyond it.

`recommend` maps (optimiser, schedule, K, momentum, ...) to the config fields the studies
chose on held-out data (benchmarks/time_to_quality.py and benchmarks/delay_robust.py,
docs/staleness.md): a staleness remedy (`fdg_jax.optim.methods` names it), a warm-up where
the study lengthened it, and for the Adam family rotated Adam
(`fdg_jax.optim.adaptive.basis_rotation`) in the optimiser's place. `STUDY` is the table of
those choices, cell by cell; a cell the study did not run gets nothing. `state_memory` and
`tree_bytes` size the optimiser state a switch costs, for the line the trainer prints.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import jax
import jax.numpy as jnp

from fdg_jax import plans
from fdg_jax.optim.adaptive import basis_rotation

AUTO_SGD = {"staleness": "spike_compensation+weight_prediction"}
AUTO_SGD_FDG4 = {"staleness": "nesterov_delay", "nesterov_gamma": 0.9}
# The time-to-quality GPT's choices (rotated Adam; docs/staleness.md, part gpt_long). A
# warm-up of a third of the run: `WARMUP` (the protocol's 0.3333) x the run's num_epochs.
WARMUP = "warmup_fraction"
AUTO_ADAM_DDG4 = {"staleness": "error_feedback+weight_prediction", "staleness_strength": 1.0}
AUTO_ADAM_FDG4 = {"staleness": "error_feedback", "staleness_strength": 1.0, WARMUP: 0.3333}
AUTO_ADAM_FDG8 = {"staleness": "error_feedback", "staleness_strength": 0.5, WARMUP: 0.3333}
AUTO_ADAM = {"optimizer": "basis_rotation", **AUTO_ADAM_FDG8}  # at FDG K = 8
ROTATED = AUTO_ADAM["optimizer"]
# The Adam family as the study ran it: adamw (adam is the same at weight decay 0, as the
# study ran it), nadam_warmup, and rotated Adam itself. `auto` may replace these, and only
# these, by rotated Adam; muon (studied, but not Adam), lion, optax's nadam, ...: never.
ADAM_FAMILY = ("adam", "adamw", "nadam_warmup", ROTATED)
SGD_MOMENTUM = 0.9  # the only SGD momentum of the study (the MLP, heavy ball)
STUDIED_K = (4, 8)


def _ef(strength: float) -> dict:
  return {"staleness": "error_feedback", "staleness_strength": strength}


# family -> {(algorithm, K): (the optimiser the study chose in the family's place, or None for
# the user's; the remedy it chose, or None where none was tried)}. A cell absent: not run.
# sgd: the MLP (spike_compensation+weight_prediction at both K = 8 cells and every width;
#   nesterov_delay 0.9 at FDG K = 4 at widths 96 and 128, error_feedback 0.5 at width 64;
#   DDG K = 4: the lr grid only). adam: rotated Adam (best in every cell of the ViT and the
#   GPT of delay_robust.py); its remedies from the time-to-quality GPT (part gpt_long, held
#   out at 1,500 steps: error_feedback 1 & weight_prediction at DDG K = 4, error_feedback 1
#   with a third of the run as warm-up at FDG K = 4, error_feedback 0.5 with that warm-up at
#   FDG K = 8); DDG K = 8: the ViT of delay_robust.py, no remedy tried. muon: the GPT of
#   delay_robust.py (error_feedback, its strength as chosen per cell; the ViT tried no
#   remedy for it; DDG K = 8 not run).
STUDY = {
    "sgd": {("ddg", 4): (None, None), ("fdg", 4): (None, AUTO_SGD_FDG4),
            ("ddg", 8): (None, AUTO_SGD), ("fdg", 8): (None, AUTO_SGD)},
    "adam": {("ddg", 4): (ROTATED, AUTO_ADAM_DDG4), ("fdg", 4): (ROTATED, AUTO_ADAM_FDG4),
             ("ddg", 8): (ROTATED, None), ("fdg", 8): (ROTATED, AUTO_ADAM_FDG8)},
    "muon": {("ddg", 4): (None, _ef(1.0)), ("fdg", 4): (None, _ef(0.5)),
             ("fdg", 8): (None, _ef(1.0))},
}
_FAMILY_NAMES = {"sgd": "SGD with momentum 0.9", "adam": "the Adam family", "muon": "muon"}


def _family(optimizer: str, momentum: float, nesterov: bool) -> tuple[Optional[str], str]:
  """(the study's family of the optimiser or None, what it is when None)."""
  if optimizer == "sgd":
    if nesterov:
      return None, "sgd with Nesterov momentum"
    if not momentum:
      return None, "sgd without momentum"
    if abs(momentum - SGD_MOMENTUM) > 1e-9:
      return None, f"sgd with momentum {momentum:g}; the study ran {SGD_MOMENTUM:g}"
    return "sgd", ""
  if optimizer in ADAM_FAMILY:
    if nesterov and optimizer in ("adam", "adamw"):  # optax's adam(w) turns into NAdam(W)
      return None, f"{optimizer} with nesterov=True"
    return "adam", ""
  if optimizer == "muon":
    return "muon", ""
  return None, optimizer


def _cell(family: str, algorithm: str, K: int):
  """((optimiser, remedy), where) of the study at (algorithm, K), or (None, why not)."""
  cells = STUDY[family]
  lo, hi = STUDIED_K
  name = f"{algorithm.upper()} K={K}"
  if (algorithm, K) in cells:
    return cells[(algorithm, K)], f"at {name}"
  if lo < K < hi and (algorithm, lo) in cells and (algorithm, hi) in cells:
    (o1, r1), (o2, r2) = cells[(algorithm, lo)], cells[(algorithm, hi)]
    return ((o1 if o1 == o2 else None, r1 if r1 == r2 else None),
            f"at both {algorithm.upper()} K={lo} and K={hi}")
  ran = " and ".join(str(k) for a, k in sorted(cells) if a == algorithm)
  return None, f"{name} not studied for {_FAMILY_NAMES[family]}; it ran K = {ran}"


def _config_fields(remedy: dict, num_epochs) -> dict:
  """A remedy as config fields: a warm-up fraction becomes warmup_epochs of this run."""
  fields = {k: v for k, v in remedy.items() if k != WARMUP}
  if WARMUP in remedy:
    if num_epochs is None:
      raise ValueError("this choice sets a warm-up of a fraction of the run: pass num_epochs")
    fields["warmup_epochs"] = remedy[WARMUP] * num_epochs  # as the study's protocol did
  return fields


def describe(fields: dict) -> str:
  """Config fields as the start line names them: 'error_feedback, staleness_strength 0.5'."""
  return fields["staleness"] + "".join(f", {k} {v:g}" if isinstance(v, float) else f", {k} {v}"
                                       for k, v in fields.items() if k != "staleness")


def recommend(optimizer: str, algorithm: str, *, num_stages: int, momentum: float = 0.0,
              nesterov: bool = False, beta: float = 1.0, backward: str = "stash",
              hparams=(), num_epochs: float | None = None) -> tuple[dict, str]:
  """What `--config.staleness=auto` sets: (config fields, one line saying so).

  Exactly the held-out choices of the studies (docs/staleness.md, `STUDY`), and nothing
  where they did not choose:

  - SGD with heavy-ball momentum 0.9 (the MLP): `spike_compensation+weight_prediction` at
    DDG and FDG K = 8; `nesterov_delay` with nesterov_gamma 0.9 at FDG K = 4; nothing at
    DDG K = 4 (no remedy was tried there).
  - The Adam family, `ADAM_FAMILY` (adam, adamw and nadam_warmup, which the ViT and GPT
    studies ran rotated Adam against, and basis_rotation itself): the optimiser becomes
    `basis_rotation` under BP, GPipe and 1F1B (no correction: the study's best BP optimiser,
    so BP and the delayed runs compare one optimiser) and under DDG and FDG at K = 4 to 8;
    with the time-to-quality GPT's choices (benchmarks/time_to_quality.py, part gpt_long):
    `error_feedback+weight_prediction` strength 1 at DDG K = 4; `error_feedback` strength
    1 at FDG K = 4 and 0.5 at FDG K = 8, both with a warm-up of a third of the run
    (warmup_epochs = 0.3333 x num_epochs, replacing the config's); no remedy at DDG K = 5
    to 8 (none was tried at DDG K = 8) and FDG K = 5 to 7 (K = 4 and 8 chose different
    strengths). adam(w) with nesterov=True (NAdam) is not the family. If the user's
    optimiser parameters (optimizer_kwargs, b1/b2/eps) include one that basis_rotation
    lacks, nothing changes (the remedy was chosen with rotated Adam only). Where the
    optimiser is switched, `fdg_jax.trainer.resolve_auto` adds both optimisers'
    state for the config's model to the line (`state_memory`; rotated Adam's was 4.45x
    AdamW's on the study's ViT and 4.27x on its GPT, docs/results/optimizer_cost_*.json).
  - Muon (the GPT): its own optimiser kept, `error_feedback` strength 1 at DDG K = 4 and
    FDG K = 8, 0.5 at FDG K = 4 (each cell's choice); nothing at DDG K = 8 (not run) or
    under BP.
  - Anything else (SGD with another momentum, Nesterov's or none; lion, optax's nadam, ...):
    nothing; no optimiser outside `ADAM_FAMILY` is ever replaced.

  K: the study ran K = 4 and 8. A K in between (5, 6, 7) counts as studied for each of the
  two choices, the optimiser and the remedy, only where the study made that same choice at
  both K = 4 and K = 8 (so the Adam family gets rotated Adam alone under DDG and FDG; SGD
  and Muon get nothing there). K = 2, 3 or above 8:
  nothing, the optimiser included. A delayed schedule other than the study's (beta != 1,
  backward="recompute"): nothing. K = 1 and BP, GPipe, 1F1B have no delay: no correction.

  The learning rate and every other field stay the user's, and so does the warm-up except
  where the choice sets one. `hparams`: the names of the optimiser parameters the config
  sets (`config_check.optimizer_hparams`); `num_epochs`: the run's (for a warm-up fraction).
  """
  none = {"staleness": "none"}
  family, what = _family(optimizer, momentum, nesterov)
  swappable = family == "adam" and optimizer != ROTATED
  lacking = sorted(set(hparams) - set(inspect.signature(basis_rotation).parameters))
  blocked = (f"{ROTATED}, the study's optimiser for {optimizer}, has no parameter "
             f"{', '.join(lacking)}: set the optimiser and staleness by hand")
  delayed = plans.spec(algorithm).delayed
  if not delayed or num_stages == 1:
    why = f"{algorithm}{' K=1' if delayed else ''}: no delay to correct"
    if swappable and not lacking:
      return {"optimizer": ROTATED, "staleness": "none"}, (
          f"staleness=auto: none ({why}); optimizer {optimizer} -> {ROTATED} (the study's "
          "best optimiser under BP, and its choice under DDG and FDG)")
    return none, f"staleness=auto: none ({why}{'; ' + blocked if swappable else ''})"
  if family is None:
    return none, f"staleness=auto: none (no remedy studied for {what})"
  if beta != 1.0 or backward != "stash":
    return none, (f"staleness=auto: none (the study ran beta 1 and backward stash, not beta "
                  f"{beta:g} with backward {backward})")
  cell, where = _cell(family, algorithm, num_stages)
  if cell is None:
    return none, f"staleness=auto: none ({where})"
  switch, remedy = cell
  switch = switch if switch and switch != optimizer else None
  if switch and lacking:
    return none, f"staleness=auto: none ({blocked})"
  who = _FAMILY_NAMES[family]
  fields = _config_fields(remedy or none, num_epochs)
  warm = (f"warm-up {remedy[WARMUP]:g} x num_epochs {num_epochs:g}; "
          if remedy and WARMUP in remedy else "")
  if remedy:
    line = f"staleness=auto: {describe(fields)}"
  elif where.startswith("at both"):
    line = (f"staleness=auto: none (no remedy common to the study's {algorithm.upper()} "
            f"K={STUDIED_K[0]} and K={STUDIED_K[1]})")
  else:
    line = f"staleness=auto: none (no remedy tried for {who} {where})"
  if switch:
    fields["optimizer"] = switch
    line += f"; optimizer {optimizer} -> {switch} ({warm}the study's choice for {who} {where})"
  elif remedy:
    line += f" ({warm}the study's choice for {who} {where})"
  return fields, line


def _size(n: int) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"


def state_memory(old_name: str, old: int, new_name: str, new: int, params: int) -> str:
  """The start line's clause on a switched optimiser's state (bytes for the user's model)."""
  ratio = f", {new / old:.2f}x" if old else ""
  return (f"{new_name}'s state {_size(new)} against {old_name}'s {_size(old)} for this "
          f"model's {_size(params)} of parameters (+{_size(new - old)}{ratio})")


def tree_bytes(tree) -> int:
  """The bytes of a pytree's arrays (or of `jax.eval_shape`'s ShapeDtypeStructs)."""
  return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
