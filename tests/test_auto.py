"""`--config.staleness=auto`: the study's recommendation, said in one line, and exactly the
run of the same settings written out by hand."""

import json

from fdg_jax import staleness, trainer
from test_trainer import _params_equal, tiny_config


def test_recommendations_by_family_and_schedule():
  fields, line = staleness.recommend("sgd", "fdg", momentum=0.9)
  assert fields == {"staleness": "spike_compensation+weight_prediction"}
  assert line.startswith("staleness=auto: spike_compensation+weight_prediction")
  assert staleness.recommend("sgd", "bp", momentum=0.9)[0] == {"staleness": "none"}
  assert staleness.recommend("sgd", "ddg", momentum=0.0)[0] == {"staleness": "none"}
  assert staleness.recommend("sgd", "fdg", momentum=0.9, nesterov=True)[0] == {
      "staleness": "none"}
  for algorithm in ("bp", "ddg", "fdg"):
    fields, line = staleness.recommend("adamw", algorithm)
    assert fields["staleness"] in staleness.METHODS or "+" in fields["staleness"]
    if algorithm == "bp":
      assert fields["staleness"] == "none"
    # the optimiser, if changed, changes for BP too
    assert fields.get("optimizer") == staleness.recommend("adamw", "fdg")[0].get("optimizer")


def test_adaptive_optimisers_get_the_studies_choice():
  assert staleness.recommend("adamw", "fdg") == (
      {"optimizer": "basis_rotation", "staleness": "error_feedback", "staleness_strength": 0.5},
      "staleness=auto: error_feedback, staleness_strength 0.5; optimizer adamw -> "
      "basis_rotation (the study's choice for adaptive optimisers)")
  assert staleness.recommend("adam", "ddg")[0] == {
      "optimizer": "basis_rotation", "staleness": "error_feedback", "staleness_strength": 0.5}
  assert staleness.recommend("muon", "bp")[0] == {"optimizer": "basis_rotation",
                                                  "staleness": "none"}
  # already the recommended optimiser: only the remedy
  assert staleness.recommend("basis_rotation", "fdg")[0] == {
      "staleness": "error_feedback", "staleness_strength": 0.5}


def test_auto_is_the_recommended_run_and_says_so(tmp_path, capsys):
  c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=1, momentum=0.9,
                  learning_rate=0.02, staleness="auto")
  auto = trainer.train_and_evaluate(c, str(tmp_path / "auto"))
  out = capsys.readouterr().out
  assert "staleness=auto: spike_compensation+weight_prediction" in out
  with open(tmp_path / "auto" / "config.json") as f:
    assert json.load(f)["staleness"] == "spike_compensation+weight_prediction"
  c.staleness = "spike_compensation+weight_prediction"
  explicit = trainer.train_and_evaluate(c, str(tmp_path / "explicit"))
  assert _params_equal(auto["params"], explicit["params"])
