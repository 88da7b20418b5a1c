"""`--config.staleness=auto`: exactly the study's choices (per optimiser family, schedule, K
and momentum), nothing outside them, said in one line; and through the trainer, exactly the
run of the same settings written out by hand."""

import json
import re

import jax
import numpy as np
import pytest

from fdg_jax import staleness, trainer
from fdg_jax.optim import make_optimizer
from test_trainer import _params_equal, read_metrics, tiny_config

NONE = {"staleness": "none"}
EF_HALF = {"staleness": "error_feedback", "staleness_strength": 0.5}
EF_ONE = {"staleness": "error_feedback", "staleness_strength": 1.0}
E = 3  # the run's epochs: the GPT's choices at FDG set a warm-up of a third of them
WARM = {"warmup_epochs": 0.3333 * E}
ADAM_DDG4 = {"staleness": "error_feedback+weight_prediction", "staleness_strength": 1.0}
ADAM_FDG4, ADAM_FDG8 = {**EF_ONE, **WARM}, {**EF_HALF, **WARM}
ROT = {"optimizer": "basis_rotation"}
ROTATED_ONLY = {"staleness": "none", "optimizer": "basis_rotation"}
SPIKE = {"staleness": "spike_compensation+weight_prediction"}
NAG = {"staleness": "nesterov_delay", "nesterov_gamma": 0.9}


def fields(optimizer, algorithm, K, **kw):
  return staleness.recommend(optimizer, algorithm, num_stages=K, num_epochs=E, **kw)[0]


def line(optimizer, algorithm, K, **kw):
  out = staleness.recommend(optimizer, algorithm, num_stages=K, num_epochs=E, **kw)[1]
  assert "\n" not in out and out.startswith("staleness=auto: ")
  return out


@pytest.mark.parametrize("algorithm,K,expected", [
    ("fdg", 8, SPIKE), ("ddg", 8, SPIKE), ("fdg", 4, NAG), ("ddg", 4, NONE),
    ("fdg", 6, NONE), ("ddg", 5, NONE), ("fdg", 2, NONE), ("fdg", 16, NONE),
    ("bp", 1, NONE), ("gpipe", 4, NONE), ("1f1b", 8, NONE), ("fdg", 1, NONE)])
def test_sgd_momentum_09_per_schedule_and_K(algorithm, K, expected):
  assert fields("sgd", algorithm, K, momentum=0.9) == expected


def test_sgd_outside_the_study_changes_nothing():
  for kw in (dict(momentum=0.5), dict(momentum=0.0), dict(momentum=0.99),
             dict(momentum=0.9, nesterov=True), dict(momentum=0.9, beta=0.5),
             dict(momentum=0.9, backward="recompute")):
    assert fields("sgd", "fdg", 8, **kw) == NONE, kw
  assert line("sgd", "fdg", 8, momentum=0.5) == (
      "staleness=auto: none (no remedy studied for sgd with momentum 0.5; the study ran 0.9)")
  assert line("sgd", "ddg", 8, momentum=0.0) == (
      "staleness=auto: none (no remedy studied for sgd without momentum)")
  assert line("sgd", "fdg", 4, momentum=0.9, nesterov=True) == (
      "staleness=auto: none (no remedy studied for sgd with Nesterov momentum)")
  assert line("sgd", "fdg", 16, momentum=0.9) == (
      "staleness=auto: none (FDG K=16 not studied for SGD with momentum 0.9; it ran K = 4 "
      "and 8)")
  assert line("sgd", "ddg", 4, momentum=0.9) == (
      "staleness=auto: none (no remedy tried for SGD with momentum 0.9 at DDG K=4)")
  assert line("sgd", "fdg", 6, momentum=0.9) == (
      "staleness=auto: none (no remedy common to the study's FDG K=4 and K=8)")
  assert line("sgd", "fdg", 8, momentum=0.9, backward="recompute") == (
      "staleness=auto: none (the study ran beta 1 and backward stash, not beta 1 with "
      "backward recompute)")
  assert line("sgd", "bp", 1, momentum=0.9) == "staleness=auto: none (bp: no delay to correct)"


def test_sgd_lines_name_the_studied_cell():
  assert line("sgd", "fdg", 8, momentum=0.9) == (
      "staleness=auto: spike_compensation+weight_prediction (the study's choice for SGD with "
      "momentum 0.9 at FDG K=8)")
  assert line("sgd", "fdg", 4, momentum=0.9) == (
      "staleness=auto: nesterov_delay, nesterov_gamma 0.9 (the study's choice for SGD with "
      "momentum 0.9 at FDG K=4)")


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "nadam_warmup"])
@pytest.mark.parametrize("algorithm,K,expected", [
    ("fdg", 4, {**ADAM_FDG4, **ROT}), ("fdg", 8, {**ADAM_FDG8, **ROT}),
    ("fdg", 6, ROTATED_ONLY), ("ddg", 4, {**ADAM_DDG4, **ROT}), ("ddg", 8, ROTATED_ONLY),
    ("ddg", 7, ROTATED_ONLY),
    ("bp", 1, ROTATED_ONLY), ("bp", 4, ROTATED_ONLY), ("gpipe", 4, ROTATED_ONLY),
    ("1f1b", 2, ROTATED_ONLY), ("ddg", 1, ROTATED_ONLY),
    ("fdg", 2, NONE), ("fdg", 3, NONE), ("ddg", 12, NONE), ("fdg", 16, NONE)])
def test_adam_family_per_schedule_and_K(optimizer, algorithm, K, expected):
  assert fields(optimizer, algorithm, K) == expected


def test_adam_family_lines_and_what_blocks_the_switch():
  assert line("adamw", "fdg", 4) == (
      "staleness=auto: error_feedback, staleness_strength 1, warmup_epochs 0.9999; optimizer "
      "adamw -> basis_rotation (warm-up 0.3333 x num_epochs 3; the study's choice for the Adam "
      "family at FDG K=4)")
  assert line("adamw", "ddg", 4) == (
      "staleness=auto: error_feedback+weight_prediction, staleness_strength 1; optimizer "
      "adamw -> basis_rotation (the study's choice for the Adam family at DDG K=4)")
  assert line("adamw", "fdg", 6) == (
      "staleness=auto: none (no remedy common to the study's FDG K=4 and K=8); optimizer "
      "adamw -> basis_rotation (the study's choice for the Adam family at both FDG K=4 and "
      "K=8)")
  assert line("adamw", "ddg", 8) == (
      "staleness=auto: none (no remedy tried for the Adam family at DDG K=8); optimizer "
      "adamw -> basis_rotation (the study's choice for the Adam family at DDG K=8)")
  assert line("adam", "bp", 1) == (
      "staleness=auto: none (bp: no delay to correct); optimizer adam -> basis_rotation (the "
      "study's best optimiser under BP, and its choice under DDG and FDG)")
  assert line("adamw", "fdg", 2) == (
      "staleness=auto: none (FDG K=2 not studied for the Adam family; it ran K = 4 and 8)")
  # already rotated Adam: the remedy alone
  assert fields("basis_rotation", "fdg", 8) == ADAM_FDG8
  assert fields("basis_rotation", "ddg", 4) == ADAM_DDG4
  assert line("basis_rotation", "fdg", 8) == (
      "staleness=auto: error_feedback, staleness_strength 0.5, warmup_epochs 0.9999 (warm-up "
      "0.3333 x num_epochs 3; the study's choice for the Adam family at FDG K=8)")
  # the warm-up is a fraction of the run: without the run's epochs, no answer
  with pytest.raises(ValueError, match="num_epochs"):
    staleness.recommend("adamw", "fdg", num_stages=4)
  assert fields("basis_rotation", "ddg", 8) == NONE
  assert fields("basis_rotation", "bp", 1) == NONE
  # the settings rotated Adam takes carry over; one it lacks stops the switch and the remedy
  assert fields("adamw", "fdg", 4, hparams=("b1", "b2", "eps")) == {**ADAM_FDG4, **ROT}
  assert fields("adamw", "fdg", 4, hparams=("b1", "eps_root")) == NONE
  assert fields("nadam_warmup", "bp", 1, hparams=("momentum_decay",)) == NONE
  assert line("adamw", "fdg", 4, hparams=("eps_root",)) == (
      "staleness=auto: none (basis_rotation, the study's optimiser for adamw, has no parameter "
      "eps_root: set the optimiser and staleness by hand)")
  # NAdam(W) through optax's nesterov flag, another schedule than the study's: nothing
  assert fields("adamw", "fdg", 4, nesterov=True) == NONE
  assert fields("adam", "bp", 1, nesterov=True) == NONE
  assert fields("adamw", "fdg", 4, beta=0.5) == NONE
  assert fields("adamw", "ddg", 4, backward="recompute") == NONE


@pytest.mark.parametrize("algorithm,K,expected", [
    ("ddg", 4, EF_ONE), ("fdg", 4, EF_HALF), ("fdg", 8, EF_ONE),
    ("ddg", 8, NONE), ("ddg", 6, NONE), ("fdg", 6, NONE), ("fdg", 2, NONE),
    ("bp", 1, NONE), ("gpipe", 4, NONE)])
def test_muon_keeps_its_optimiser(algorithm, K, expected):
  assert fields("muon", algorithm, K, hparams=("adam_learning_rate",)) == expected


def test_no_optimiser_outside_the_adam_family_is_replaced():
  for optimizer in ("muon", "lion", "nadam", "nadamw", "adafactor", "sgd", "rmsprop"):
    for algorithm, K in (("bp", 1), ("gpipe", 4), ("ddg", 4), ("fdg", 4), ("fdg", 8),
                         ("ddg", 8), ("fdg", 6)):
      for momentum in (0.0, 0.5, 0.9):
        got = fields(optimizer, algorithm, K, momentum=momentum)
        assert "optimizer" not in got, (optimizer, algorithm, K, momentum)
  for optimizer in ("lion", "nadam", "adafactor"):
    assert fields(optimizer, "fdg", 4) == NONE
    assert line(optimizer, "fdg", 4) == f"staleness=auto: none (no remedy studied for {optimizer})"
  assert line("muon", "ddg", 8) == (
      "staleness=auto: none (DDG K=8 not studied for muon; it ran K = 4)")
  assert line("muon", "fdg", 8) == (
      "staleness=auto: error_feedback, staleness_strength 1 (the study's choice for muon at "
      "FDG K=8)")


# ------------------------------------------------------------------ through the trainer


def _state_bytes(optimizer, params, **kw):
  tx = make_optimizer(optimizer, 1e-3, momentum=0.0, **kw)
  return sum(staleness.tree_bytes(jax.eval_shape(tx.init, p)) for p in params)


def _kib(text):
  return float(text) * 2**10


def test_auto_adamw_is_rotated_adam_with_error_feedback(tmp_path, capsys):
  c = tiny_config(algorithm="fdg", num_stages=4, num_epochs=1, max_steps=6, optimizer="adamw",
                  learning_rate=1e-3, momentum=0.0, weight_decay=0.0, staleness="auto")
  auto = trainer.train_and_evaluate(c, str(tmp_path / "auto"))
  out = [l for l in capsys.readouterr().out.splitlines() if "staleness=auto" in l]
  assert len(out) == 1
  head = ("staleness=auto: error_feedback, staleness_strength 1, warmup_epochs 0.3333; "
          "optimizer adamw -> basis_rotation (warm-up 0.3333 x num_epochs 1; the study's "
          "choice for the Adam family at FDG K=4); ")
  assert head in out[0]
  m = re.search(r"basis_rotation's state ([\d.]+) KiB against adamw's ([\d.]+) KiB for this "
                r"model's ([\d.]+) KiB of parameters \(\+([\d.]+) KiB, ([\d.]+)x\)$", out[0])
  assert m, out[0]
  new, old, params, extra = (_kib(g) for g in m.groups()[:4])
  # the same states built on the run's own per-stage parameters (a few bytes of step
  # counters per stage apart)
  stage_params = auto["params"]
  assert params == pytest.approx(staleness.tree_bytes(stage_params), abs=6)
  assert old == pytest.approx(_state_bytes("adamw", stage_params), rel=2e-3)
  assert new == pytest.approx(_state_bytes("basis_rotation", stage_params), rel=2e-3)
  assert extra == pytest.approx(new - old, abs=16)
  assert float(m.group(5)) == pytest.approx(new / old, abs=0.01)
  assert new / old > 2  # rotated Adam's bases and statistics on top of Adam's two moments
  saved = json.load(open(tmp_path / "auto" / "config.json"))
  assert (saved["optimizer"], saved["staleness"], saved["staleness_strength"],
          saved["warmup_epochs"]) == ("basis_rotation", "error_feedback", 1.0, 0.3333)
  c.staleness, c.optimizer, c.staleness_strength = "error_feedback", "basis_rotation", 1.0
  c.warmup_epochs = 0.3333
  explicit = trainer.train_and_evaluate(c, str(tmp_path / "explicit"))
  assert _params_equal(auto["params"], explicit["params"])


def test_auto_sgd_momentum_09_at_k8_is_the_studied_remedy(tmp_path, capsys):
  c = tiny_config(algorithm="fdg", num_stages=8, num_epochs=1, max_steps=6, momentum=0.9,
                  learning_rate=0.02, staleness="auto")
  c.model_kwargs.widths = (16,) * 7  # 8 blocks
  auto = trainer.train_and_evaluate(c, str(tmp_path / "auto"))
  assert ("staleness=auto: spike_compensation+weight_prediction (the study's choice for SGD "
          "with momentum 0.9 at FDG K=8)\n") in capsys.readouterr().out
  with open(tmp_path / "auto" / "config.json") as f:
    assert json.load(f)["staleness"] == "spike_compensation+weight_prediction"
  c.staleness = "spike_compensation+weight_prediction"
  explicit = trainer.train_and_evaluate(c, str(tmp_path / "explicit"))
  assert _params_equal(auto["params"], explicit["params"])


@pytest.mark.parametrize("name,overrides,kwargs,expected_line,expected", [
    ("muon", dict(optimizer="muon", learning_rate=0.02, weight_decay=0.0, momentum=0.0),
     {"adam_learning_rate": 1e-3},
     "staleness=auto: error_feedback, staleness_strength 0.5 (the study's choice for muon at "
     "FDG K=4)", {"optimizer": "muon", "staleness": "error_feedback",
                  "staleness_strength": 0.5}),
    ("lion", dict(optimizer="lion", learning_rate=1e-4, weight_decay=0.0, momentum=0.0), {},
     "staleness=auto: none (no remedy studied for lion)",
     {"optimizer": "lion", "staleness": "none", "staleness_strength": 1.0}),
    ("sgd_m0.5", dict(momentum=0.5, learning_rate=0.05), {},
     "staleness=auto: none (no remedy studied for sgd with momentum 0.5; the study ran 0.9)",
     {"optimizer": "sgd", "staleness": "none", "staleness_strength": 1.0}),
])
def test_auto_outside_the_adam_family_trains_with_its_own_optimiser(
    name, overrides, kwargs, expected_line, expected, tmp_path, capsys):
  c = tiny_config(algorithm="fdg", num_stages=4, num_epochs=1, max_steps=6, staleness="auto",
                  **overrides)
  c.optimizer_kwargs = kwargs
  result = trainer.train_and_evaluate(c, str(tmp_path))
  out = [l for l in capsys.readouterr().out.splitlines() if "staleness=auto" in l]
  assert out == [expected_line], out
  saved = json.load(open(tmp_path / "config.json"))
  assert {k: saved[k] for k in expected} == expected
  assert saved["optimizer_kwargs"] == kwargs
  records = read_metrics(tmp_path)
  assert records[-1]["step"] == 6
  assert all(np.isfinite(r["train_loss"]) for r in records)
  assert np.isfinite(result["test_loss"])
