"""`--config.staleness=auto`: the time-to-quality study's held-out choice in each cell it ran
(derived from the committed records and compared with `auto.STUDY`), nothing outside them,
said in one line; and through the trainer, exactly the run of the same settings written out
by hand."""

import json
import pathlib
import sys

import pytest

from fdg_jax import staleness, trainer
from fdg_jax.optim import auto
from test_trainer import _params_equal, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import time_to_quality as ttq  # noqa: E402

NONE = {"staleness": "none"}
E, LR = 3, 0.1  # the run's epochs (a warm-up is a fraction of them) and the user's rate
PARTS = ("fashion_mlp", "gpt_long")


def recommend(optimizer, algorithm, K, **kw):
  return staleness.recommend(optimizer, algorithm, num_stages=K, num_epochs=E,
                             learning_rate=LR, **kw)


def fields(*args, **kw):
  return recommend(*args, **kw)[0]


def line(*args, **kw):
  out = recommend(*args, **kw)[1]
  assert "\n" not in out and out.startswith("staleness=auto: ")
  return out


def _study(part: str, records: dict | None = None):
  path = ROOT / "docs" / "results" / f"time_to_quality_{part}.json"
  records = json.loads(path.read_text())["records"] if records is None else records
  study = ttq.Study(ttq.load_protocol(), part, ttq.ReadOnly(records), records)
  study.select()
  return study


# ------------------------------------------------ the table is the study's, cell by cell


@pytest.mark.parametrize("part", PARTS)
def test_the_table_is_the_held_out_choice_derived_from_the_committed_records(part):
  study = _study(part)
  assert ttq.auto_mismatch(study) is None
  derived = ttq.derive_auto(study)
  row = next(r for r in auto.STUDY if r.part == part)
  # every delayed schedule the part ran is a cell, and recommend applies it to a user's run
  delayed = [v for v in study.spec["schedules"].values() if v["algorithm"] != "bp"]
  assert len(derived.cells) == len(delayed) >= 3
  for (algorithm, K), choice in derived.cells.items():
    got = fields(row.optimizer, algorithm, K, momentum=row.momentum or 0.0)
    want = {"staleness": "none", **choice.fields,
            **{k: v * E for k, v in choice.fractions.items()}}
    if choice.lr_mult != 1.0:
      want["learning_rate"] = pytest.approx(LR * choice.lr_mult, rel=1e-12)
    assert got == want, (part, algorithm, K)


def test_every_row_comes_from_a_part_that_ran_and_nothing_else_is_set():
  protocol = ttq.load_protocol()
  assert {r.part for r in auto.STUDY} == set(PARTS)
  for row in auto.STUDY:
    assert protocol["parts"][row.part]["status"].startswith("run")
  # the cells the study did not run get nothing, whatever the optimiser
  for optimizer, momentum in (("sgd", 0.9), ("basis_rotation", 0.0)):
    for algorithm, K in (("ddg", 8), ("ddg", 2), ("fdg", 2), ("fdg", 6), ("fdg", 16),
                         ("ddg", 5)):
      assert fields(optimizer, algorithm, K, momentum=momentum) == NONE, (optimizer, K)


def test_a_table_that_is_not_the_study_is_found(monkeypatch):
  """The comparison can fail: a changed cell of the table, or records that choose otherwise."""
  study = _study("fashion_mlp")
  row = next(r for r in auto.STUDY if r.part == "fashion_mlp")
  for cells in ({**row.cells, ("fdg", 4): auto.Choice(1.0)},
                {**row.cells, ("fdg", 4): auto.Choice(0.5, {"staleness": "nesterov_delay",
                                                             "nesterov_gamma": 0.9})},
                {k: v for k, v in row.cells.items() if k != ("ddg", 4)}):
    other = tuple(r if r is not row else auto.Row(row.part, row.what, row.optimizer,
                                                   row.momentum, cells) for r in auto.STUDY)
    monkeypatch.setattr(auto, "STUDY", other)
    assert ttq.auto_mismatch(study), cells
    with pytest.raises(ttq.ProtocolError, match="make fdg_jax/optim/auto.py's STUDY"):
      ttq.auto_markdown(study, {"rows": {}})
  monkeypatch.undo()
  # The held-out records moved so that FDG K=4's auto run (then nesterov_delay) clearly beats
  # the plain one at x0.5: another choice, which the table does not hold.
  path = ROOT / "docs" / "results" / "time_to_quality_fashion_mlp.json"
  records = json.loads(path.read_text())["records"]
  task = study.held_out("FDG K=4", 0.5, "auto")
  records[task["key"]] = {**records[task["key"]], "test_accuracy": 0.99}
  assert "at ('fdg', 4)" in ttq.auto_mismatch(_study("fashion_mlp", records))


# ------------------------------------------------------------------- the lines and refusals


def test_a_studied_cell_scales_the_rate_and_sets_the_remedy_in_one_line():
  assert fields("sgd", "fdg", 8, momentum=0.9) == {
      "staleness": "spike_compensation+weight_prediction", "learning_rate": 0.025}
  assert line("sgd", "fdg", 8, momentum=0.9) == (
      "staleness=auto: spike_compensation+weight_prediction, learning_rate 0.1 -> 0.025 "
      "(x0.25): the time-to-quality study's held-out choice for SGD with heavy-ball momentum "
      "0.9 at FDG K=8 (part fashion_mlp; docs/staleness.md#what-stalenessauto-sets)")
  assert fields("sgd", "ddg", 4, momentum=0.9) == NONE
  assert line("sgd", "ddg", 4, momentum=0.9).startswith(
      "staleness=auto: no remedy, learning_rate kept (x1): the time-to-quality study's "
      "held-out choice for SGD with heavy-ball momentum 0.9 at DDG K=4 (part fashion_mlp")
  assert fields("basis_rotation", "fdg", 4) == {
      "staleness": "error_feedback", "staleness_strength": 1.0, "learning_rate": 0.025,
      "warmup_epochs": pytest.approx(0.3333 * E)}
  assert line("basis_rotation", "fdg", 4).startswith(
      "staleness=auto: error_feedback, staleness_strength 1, warmup_epochs 0.9999, "
      "learning_rate 0.1 -> 0.025 (x0.25): the time-to-quality study's held-out choice for "
      "basis_rotation (rotated Adam) at FDG K=4 (part gpt_long")
  # a warm-up is a fraction of the run, a rate a multiple of the user's: both needed
  with pytest.raises(ValueError, match="num_epochs"):
    staleness.recommend("basis_rotation", "fdg", num_stages=4, learning_rate=LR)
  with pytest.raises(ValueError, match="learning_rate"):
    staleness.recommend("sgd", "fdg", num_stages=4, momentum=0.9, num_epochs=E)


def test_outside_the_study_nothing_changes_and_the_line_says_why():
  for kw in (dict(momentum=0.5), dict(momentum=0.0), dict(momentum=0.99),
             dict(momentum=0.9, nesterov=True), dict(momentum=0.9, beta=0.5),
             dict(momentum=0.9, backward="recompute")):
    assert fields("sgd", "fdg", 8, **kw) == NONE, kw
  assert line("sgd", "fdg", 8, momentum=0.5) == (
      "staleness=auto: none (the study ran SGD with heavy-ball momentum 0.9, not momentum 0.5)")
  assert line("sgd", "fdg", 4, momentum=0.9, nesterov=True) == (
      "staleness=auto: none (the study ran SGD with heavy-ball momentum 0.9, not Nesterov's)")
  assert line("sgd", "fdg", 16, momentum=0.9) == (
      "staleness=auto: none (the study ran SGD with heavy-ball momentum 0.9 at DDG K=4, "
      "FDG K=4, FDG K=8, not FDG K=16)")
  assert line("sgd", "fdg", 8, momentum=0.9, backward="recompute") == (
      "staleness=auto: none (the study ran beta 1 and backward stash, not beta 1 with "
      "backward recompute)")
  assert line("sgd", "bp", 1, momentum=0.9) == "staleness=auto: none (bp: no delay to correct)"
  assert line("sgd", "fdg", 1, momentum=0.9) == (
      "staleness=auto: none (fdg K=1: no delay to correct)")
  for algorithm, K in (("bp", 1), ("gpipe", 4), ("1f1b", 8)):
    assert fields("basis_rotation", algorithm, K) == NONE


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "nadam_warmup", "muon", "lion",
                                       "nadam", "adafactor", "rmsprop"])
def test_the_optimiser_is_never_changed(optimizer):
  for algorithm, K in (("bp", 1), ("ddg", 4), ("fdg", 4), ("fdg", 8)):
    assert fields(optimizer, algorithm, K, momentum=0.9) == NONE
  said = line(optimizer, "fdg", 4)
  assert said.startswith("staleness=auto: none (the study chose for SGD with heavy-ball "
                         f"momentum 0.9 and basis_rotation (rotated Adam) only, not {optimizer}")
  # the Adam family is pointed at the row it is near, as a command that works
  near = "; for its basis_rotation (rotated Adam) row use --config.optimizer=basis_rotation)"
  assert said.endswith(near) == (optimizer in ("adam", "adamw", "nadam_warmup"))


def test_the_docs_table_is_the_libraries():
  text = (ROOT / "docs" / "staleness.md").read_text()
  assert auto.markdown() in text, "docs/staleness.md: rerun python -m fdg_jax.optim.auto"
  assert "| SGD with heavy-ball momentum 0.9 | FDG K=8 | lr ×0.25, " in auto.markdown()


# ------------------------------------------------------------------ through the trainer


def test_auto_trains_exactly_the_cell_written_out_by_hand(tmp_path, capsys):
  c = tiny_config(algorithm="fdg", num_stages=8, num_epochs=1, max_steps=6, momentum=0.9,
                  learning_rate=0.02, staleness="auto")
  c.model_kwargs.widths = (16,) * 7  # 8 blocks
  got = trainer.train_and_evaluate(c, str(tmp_path / "auto"))
  out = [l for l in capsys.readouterr().out.splitlines() if "staleness=auto" in l]
  assert out == [line("sgd", "fdg", 8, momentum=0.9).replace("0.1 -> 0.025", "0.02 -> 0.005")]
  saved = json.load(open(tmp_path / "auto" / "config.json"))
  assert (saved["staleness"], saved["learning_rate"]) == (
      "spike_compensation+weight_prediction", 0.005)
  c.staleness, c.learning_rate = "spike_compensation+weight_prediction", 0.005
  explicit = trainer.train_and_evaluate(c, str(tmp_path / "explicit"))
  assert _params_equal(got["params"], explicit["params"])


def test_auto_outside_the_study_trains_the_users_config(tmp_path, capsys):
  c = tiny_config(algorithm="fdg", num_stages=4, num_epochs=1, max_steps=6, optimizer="adamw",
                  learning_rate=1e-3, momentum=0.0, weight_decay=0.0, staleness="auto")
  got = trainer.train_and_evaluate(c, str(tmp_path / "auto"))
  out = [l for l in capsys.readouterr().out.splitlines() if "staleness=auto" in l]
  assert out == [line("adamw", "fdg", 4)]
  saved = json.load(open(tmp_path / "auto" / "config.json"))
  assert (saved["optimizer"], saved["staleness"], saved["learning_rate"]) == (
      "adamw", "none", 1e-3)
  c.staleness = "none"
  explicit = trainer.train_and_evaluate(c, str(tmp_path / "explicit"))
  assert _params_equal(got["params"], explicit["params"])
