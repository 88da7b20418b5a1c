"""The delay-robust study's protocol (benchmarks/delay_robust.py) on a synthetic score surface.

No training: `Study.run` is replaced by a closed-form held-out loss of (optimizer, schedule, lr
multiplier, remedy), so the choices the protocol must make are known in advance.
"""

import importlib.util
import json
import math
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location("delay_robust", ROOT / "benchmarks" /
                                                "delay_robust.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


dr = _module()

# The best log2(lr multiplier) of each cell, and the held-out loss gain of each extra.
OPTIMUM = {("muon", "BP"): 0.4, ("muon", "FDG K=8"): -4.0, ("muon", "FDG K=4"): -0.6,
           ("basis_rotation", "BP"): 3.2, ("basis_rotation", "FDG K=8"): 0.1,
           ("basis_rotation", "FDG K=4"): 1.0}
GAIN = {"error_feedback 0.5": {"FDG K=4": 0.2, "FDG K=8": 0.3},
        "b1 0.98": {"FDG K=4": 0.05, "FDG K=8": 0.05, "BP": -0.1},
        "warmup 1": {"BP": 0.01, "FDG K=4": -0.3, "FDG K=8": -0.3},
        "warmup 2": {"BP": -0.2, "FDG K=4": 0.1, "FDG K=8": 0.1},
        "lr_by_delay ramp 1": {"FDG K=4": 0.04, "FDG K=8": -0.01}}


def fake_loss(optimizer, schedule, lr_mult, remedy):
  loss = 3.0 + (math.log2(lr_mult) - OPTIMUM[(optimizer, schedule)]) ** 2
  for part in (remedy.split(dr.JOIN) if remedy else ()):
    loss -= GAIN[part].get(schedule, 0.0)
  return loss


class FakeStudy(dr.Study):
  def run(self, cells, held_out):
    out = []
    for cell in cells:
      name = self.name(*cell, held_out)
      if name not in self.records:
        self.fields(*cell)  # every cell's config must build
        o, s, m, r, seed = cell
        self.records[name] = {"name": name, "diverged": False, "test_accuracy": 0.0,
                              "test_loss": fake_loss(o, s, m, r) + 0.01 * seed,
                              "cell": list(cell), "held_out": held_out}
        self.new.append(name)
      out.append(self.records[name])
    return out


def _study(tmp_path, *extra):
  args = dr.make_parser().parse_args([
      "--part", "gpt", "--lrs", "0.5", "1", "2", "4", "--schedules", "BP", "FDG K=4", "FDG K=8",
      "--optimizers", "muon", "basis_rotation", "--remedy_at", "FDG K=4", "FDG K=8",
      "--remedies", "error_feedback 0.5", "--report", "--workdir", str(tmp_path / "w"),
      "--out", str(tmp_path / "study.json"), *extra])
  study = FakeStudy(args)
  study.new = []
  return study


def test_lr_grid_grows_past_an_edge_up_to_extend_steps(tmp_path):
  study = _study(tmp_path, "--extend", "2")
  chosen = study.protocol()["chosen"]
  # interior optima are taken from the grid as given
  assert chosen[("muon", "BP")][0] == 1.0
  assert chosen[("basis_rotation", "FDG K=8")][0] == 1.0
  # optimum 2^3.2: x8 is tried, then x16 (8 was at the new edge), which is worse: 8
  assert chosen[("basis_rotation", "BP")][0] == 8.0
  assert "val_basis_rotation_bp_lr16_plain_s0" in study.new
  assert "val_basis_rotation_bp_lr32_plain_s0" not in study.new
  # optimum 2^-4 is past the two steps allowed: the grid stops at 0.5 / 4 = 0.125
  assert chosen[("muon", "FDG K=8")][0] == 0.125
  assert "val_muon_fdgk8_lr0.0625_plain_s0" not in study.new
  # and with --extend 0 the grid is the one given
  flat = _study(tmp_path / "flat", "--extend", "0").protocol()["chosen"]
  assert flat[("basis_rotation", "BP")][0] == 4.0
  assert flat[("muon", "FDG K=8")][0] == 0.5


def test_settings_are_kept_only_where_they_improve_the_held_out_score(tmp_path):
  study = _study(tmp_path, "--settings", "b1 0.98", "warmup 1")
  chosen = study.protocol()["chosen"]
  for o in ("muon", "basis_rotation"):
    assert chosen[(o, "BP")][1] == "warmup 1"
    assert chosen[(o, "FDG K=4")][1] == "error_feedback 0.5 & b1 0.98"
    assert chosen[(o, "FDG K=8")][1] == "error_feedback 0.5 & b1 0.98"
  # every setting was tried on top of each cell's earlier choice, BP included
  assert "val_muon_bp_lr1_b1_0.98_s0" in study.new
  assert "val_muon_fdgk4_lr0.5_error_feedback_0.5_&_warmup_1_s0" in study.new
  assert "val_muon_fdgk4_lr0.25_plain_s0" in study.new  # 0.5 was the bottom edge
  # the chosen settings were tested with every seed
  assert "test_basis_rotation_fdgk8_lr1_error_feedback_0.5_&_b1_0.98_s2" in study.new


def test_settings_map_to_each_optimizers_own_fields(tmp_path):
  study = _study(tmp_path)
  muon = study.fields("muon", "FDG K=4", 2.0, "error_feedback 0.5 & b1 0.98", 1)
  assert muon["optimizer_kwargs"] == {"adam_learning_rate": 2e-3, "beta": 0.98,
                                      "adam_b1": 0.98}
  assert "b1" not in muon and muon["staleness_strength"] == 0.5 and muon["seed"] == 1
  rotated = study.fields("basis_rotation", "BP", 1.0, "b1 0.95 & warmup 1", 0)
  assert rotated["b1"] == 0.95 and rotated["warmup_epochs"] == 1.0
  assert rotated["learning_rate"] == 1e-3 and "staleness" not in rotated
  try:
    study.fields("muon", "BP", 1.0, "b1 0.5", 0)
  except ValueError as e:
    assert "b1 0.5" in str(e)
  else:
    raise AssertionError("an unknown setting must be refused")


def test_the_study_json_carries_its_records_to_a_new_study(tmp_path):
  study = _study(tmp_path)
  study.run([("muon", "BP", 1.0, None, 0)], True)
  study.save_partial()
  saved = json.loads((tmp_path / "study.json").read_text())
  assert saved["partial"] and [r["name"] for r in saved["runs"]] == ["val_muon_bp_lr1_plain_s0"]
  again = _study(tmp_path)  # a new workdir would do: the records come from the JSON
  assert again.run([("muon", "BP", 1.0, None, 0)], True)[0] == saved["runs"][0]
  assert again.new == []


def test_settings_for_prunes_the_settings_to_some_finalists(tmp_path):
  study = _study(tmp_path, "--settings", "b1 0.98", "--settings_for", "basis_rotation")
  chosen = study.protocol()["chosen"]
  assert chosen[("basis_rotation", "FDG K=4")][1] == "error_feedback 0.5 & b1 0.98"
  assert chosen[("muon", "FDG K=4")][1] == "error_feedback 0.5"
  assert not [n for n in study.new if n.startswith("val_muon") and "b1" in n]


def test_settings_stack_by_forward_selection(tmp_path):
  study = _study(tmp_path, "--settings", "warmup 1", "warmup 2", "lr_by_delay ramp 1",
                 "--settings_for", "basis_rotation")
  chosen = study.protocol()["chosen"]
  assert chosen[("basis_rotation", "BP")][1] == "warmup 1"
  # round 1 takes warmup 2 (the largest gain); round 2 adds lr_by_delay where it helps
  assert chosen[("basis_rotation", "FDG K=4")][1] == (
      "error_feedback 0.5 & warmup 2 & lr_by_delay ramp 1")
  assert chosen[("basis_rotation", "FDG K=8")][1] == "error_feedback 0.5 & warmup 2"
  # two warm-ups never stack, and a delay-only setting is not tried under BP
  assert not [n for n in study.new if "warmup_1" in n and "warmup_2" in n]
  assert not [n for n in study.new if "_bp_" in n and "lr_by_delay" in n]
  # the per-stage warm-up joins the cell's remedy
  f = study.fields("basis_rotation", "FDG K=4", 2.0,
                   "error_feedback 0.5 & warmup 2 & lr_by_delay ramp 1", 0)
  assert f["staleness"] == "error_feedback+lr_by_delay"
  assert f["staleness_strength"] == 0.5 and f["staleness_ramp_epochs"] == 1.0
  assert f["warmup_epochs"] == 2.0


class DisagreeingStudy(FakeStudy):
  """Test records whose surface disagrees with the held-out one: on test, muon (the
  held-out loser in every cell) is far better."""

  def run(self, cells, held_out):
    rows = super().run(cells, held_out)
    for row in rows:
      if not held_out and not row.get("flipped"):
        row["test_loss"] += -2.0 if row["cell"][0] == "muon" else 0.0
        row["flipped"] = True
      row["test_perplexity"] = math.exp(row["test_loss"])
    return rows


def test_the_headline_reads_held_out_scores_not_test_means(tmp_path):
  args = dr.make_parser().parse_args([
      "--part", "gpt", "--lrs", "0.5", "1", "2", "4", "--schedules", "BP", "FDG K=4",
      "FDG K=8", "--optimizers", "muon", "basis_rotation", "--remedy_at", "FDG K=4",
      "--remedies", "error_feedback 0.5", "--report", "--workdir", str(tmp_path / "w"),
      "--out", str(tmp_path / "study.json")])
  study = DisagreeingStudy(args)
  study.new = []
  # basis_rotation's held-out optimum sits nearer the grid in every cell, so its held-out
  # score is the better one; muon's test loss is 2 lower everywhere.
  result = study.protocol()
  held = {o: study.score(study.records[study.name(o, "BP", *result["chosen"][(o, "BP")], 0,
                                                  True)]) for o in ("muon", "basis_rotation")}
  assert held["basis_rotation"] > held["muon"]
  text, summary = dr.report(study, result)
  assert summary["muon | BP"]["mean"] < summary["basis_rotation | BP"]["mean"]  # test: muon
  headline = text.split("Headline:")[1]
  assert "BP cell with the best held-out score (basis_rotation" in headline
  assert "- FDG K=4: basis_rotation" in headline
