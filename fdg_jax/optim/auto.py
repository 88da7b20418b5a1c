"""`--config.staleness=auto`: the time-to-quality study's held-out choice, and nothing else.

The time-to-quality study (benchmarks/time_to_quality.py, its protocol committed before its
runs) chose, for each optimiser it ran and each delayed cell (schedule, K), a learning rate
and a staleness remedy on a held-out split of the training data. `STUDY` is those choices,
cell by cell: the learning rate as a multiple of the rate the same part chose for BP (so that
`auto` scales the user's rate, taken to be one that suits BP), and the remedy as config
fields and fractions of the run, or no remedy. `recommend` returns a cell's choice for a
config that matches it, and nothing for any other (another optimiser, momentum, K, beta,
...); it never changes the optimiser. tests/test_auto.py derives this table from the
study's committed records and compares it with this one, cell by cell.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from fdg_jax import plans


@dataclasses.dataclass(frozen=True)
class Choice:
  """A cell's held-out choice. `lr_mult`: its chosen learning rate over BP's chosen one in
  the same part; `fields`: the remedy's config fields ({}: no remedy); `fractions`: config
  fields set to a fraction of the run's num_epochs (a warm-up of a third of it, say)."""
  lr_mult: float
  fields: Mapping = dataclasses.field(default_factory=dict)
  fractions: Mapping = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Row:
  """The study's choices for one optimiser: `part` of the protocol, what it ran (`what`),
  the optimiser's name and, for SGD, its heavy-ball momentum; `cells`: (algorithm, K) ->
  Choice."""
  part: str
  what: str
  optimizer: str
  momentum: Optional[float]
  cells: Mapping


# Derived from the records by tests/test_auto.py: edit it only with the records.
STUDY = (
    Row(part="fashion_mlp", what="SGD with heavy-ball momentum 0.9", optimizer="sgd",
        momentum=0.9, cells={
            ("ddg", 4): Choice(1.0),
            ("fdg", 4): Choice(0.5),
            ("fdg", 8): Choice(0.25, {"staleness": "spike_compensation+weight_prediction"}),
        }),
    Row(part="gpt_long", what="basis_rotation (rotated Adam)", optimizer="basis_rotation",
        momentum=None, cells={
            ("ddg", 4): Choice(0.5, {"staleness": "error_feedback+weight_prediction",
                                     "staleness_strength": 1.0}),
            ("fdg", 4): Choice(0.25, {"staleness": "error_feedback", "staleness_strength": 1.0},
                               {"warmup_epochs": 0.3333}),
            ("fdg", 8): Choice(0.125, {"staleness": "error_feedback",
                                       "staleness_strength": 0.5},
                               {"warmup_epochs": 0.3333}),
        }),
)
# Optimisers near one the study ran, which `auto` leaves alone: the line names the row.
NEAR = {"adam": "basis_rotation", "adamw": "basis_rotation", "nadam_warmup": "basis_rotation"}
DOCS = "docs/staleness.md#what-stalenessauto-sets"


def _cells(row: Row) -> str:
  return ", ".join(f"{a.upper()} K={k}" for a, k in row.cells)


def _row(optimizer: str, momentum: float, nesterov: bool) -> tuple[Optional[Row], str]:
  """(the study's row for this optimiser, or None and why not)."""
  rows = [r for r in STUDY if r.optimizer == optimizer]
  ran = " and ".join(r.what for r in STUDY)
  if not rows:
    near = next((r for r in STUDY if r.optimizer == NEAR.get(optimizer)), None)
    hint = (f"; for its {near.what} row use --config.optimizer={near.optimizer}"
            if near else "")
    return None, f"the study chose for {ran} only, not {optimizer}{hint}"
  row = rows[0]
  if row.momentum is not None:
    if nesterov:
      return None, f"the study ran {row.what}, not Nesterov's"
    if abs(momentum - row.momentum) > 1e-9:
      return None, f"the study ran {row.what}, not momentum {momentum:g}"
  return row, ""


def _fields(choice: Choice, learning_rate, num_epochs) -> dict:
  """A choice as config fields for a run at the user's `learning_rate` and `num_epochs`."""
  fields = {"staleness": "none", **choice.fields}
  if choice.lr_mult != 1.0:
    if learning_rate is None:
      raise ValueError("this choice scales the learning rate: pass learning_rate")
    fields["learning_rate"] = learning_rate * choice.lr_mult
  for name, fraction in choice.fractions.items():
    if num_epochs is None:
      raise ValueError("this choice sets a field to a fraction of the run: pass num_epochs")
    fields[name] = fraction * num_epochs  # as the study's protocol did
  return fields


def describe(fields: dict) -> str:
  """Config fields as the start line names them: 'error_feedback, staleness_strength 0.5'."""
  rest = {k: v for k, v in fields.items() if k not in ("staleness", "learning_rate")}
  return fields.get("staleness", "none") + "".join(
      f", {k} {v:g}" if isinstance(v, float) else f", {k} {v}" for k, v in rest.items())


def recommend(optimizer: str, algorithm: str, *, num_stages: int, momentum: float = 0.0,
              nesterov: bool = False, beta: float = 1.0, backward: str = "stash",
              learning_rate: float | None = None,
              num_epochs: float | None = None) -> tuple[dict, str]:
  """What `--config.staleness=auto` sets: (config fields, one line saying so).

  For an optimiser of `STUDY` (SGD with heavy-ball momentum 0.9; basis_rotation) under a
  delayed schedule and K the study ran (DDG K = 4, FDG K = 4 and 8), at beta 1 with stashed
  weights: that cell's held-out choice, i.e. the learning rate times the cell's multiple of
  BP's chosen rate (the user's rate is taken to be one that suits BP), and its remedy or
  `staleness=none`; fractions of the run (a warm-up) become fields of this run, replacing the
  config's. Anything else: `staleness=none`, and the line says why (for adam, adamw and
  nadam_warmup it names basis_rotation's row). Never changes the optimiser.
  """
  none = {"staleness": "none"}
  delayed = plans.spec(algorithm).delayed
  if not delayed or num_stages == 1:
    return none, f"staleness=auto: none ({algorithm}{' K=1' if delayed else ''}: no delay " \
                 "to correct)"
  row, why = _row(optimizer, momentum, nesterov)
  if row is None:
    return none, f"staleness=auto: none ({why})"
  if beta != 1.0 or backward != "stash":
    return none, (f"staleness=auto: none (the study ran beta 1 and backward stash, not beta "
                  f"{beta:g} with backward {backward})")
  cell = f"{algorithm.upper()} K={num_stages}"
  choice = row.cells.get((algorithm, num_stages))
  if choice is None:
    return none, (f"staleness=auto: none (the study ran {row.what} at {_cells(row)}, not "
                  f"{cell})")
  fields = _fields(choice, learning_rate, num_epochs)
  lr = (f"learning_rate {learning_rate:g} -> {fields['learning_rate']:g} "
        f"(x{choice.lr_mult:g})" if "learning_rate" in fields else "learning_rate kept (x1)")
  remedy = describe(fields) if choice.fields else "no remedy"
  return fields, (f"staleness=auto: {remedy}, {lr}: the time-to-quality study's held-out "
                  f"choice for {row.what} at {cell} (part {row.part}; {DOCS})")


def sets(choice: Choice) -> str:
  """What a choice sets, as the docs' tables say it: 'lr ×0.25, `error_feedback, ...`'."""
  out = [f"lr ×{choice.lr_mult:g}",
         f"`{describe(dict(choice.fields))}`" if choice.fields else "no remedy"]
  out += [f"{name} {fraction:g} × num_epochs" for name, fraction in choice.fractions.items()]
  return ", ".join(out)


def table() -> list[tuple[str, str, str, str]]:
  """`STUDY` as rows of (optimiser, cell, what auto sets, part), for the docs."""
  return [(row.what, f"{algorithm.upper()} K={K}", sets(c), row.part)
          for row in STUDY for (algorithm, K), c in row.cells.items()]


def markdown() -> str:
  """The docs' table of what `staleness=auto` sets (docs/staleness.md; tested)."""
  lines = ["<!-- staleness=auto's table: written by "
           "`python benchmarks/results_table.py --write` -->",
           "| optimiser | schedule, K | `staleness=auto` sets | time-to-quality part |",
           "|---|---|---|---|"]
  lines += [f"| {o} | {c} | {s} | `{p}` |" for o, c, s, p in table()]
  lines.append("| anything else | any | nothing (`staleness=none`; the line says why) | |")
  return "\n".join(lines)

