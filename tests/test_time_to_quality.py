"""The time-to-quality study's protocol (benchmarks/time_to_quality.py) on fake score surfaces.

No training: the runner writes records from closed-form surfaces, so every choice the protocol
must make is known in advance. The test surface disagrees with the held-out one everywhere a
choice is made, so a choice read from test records changes the outcome.
"""

import concurrent.futures
import copy
import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import statistics
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("time_to_quality",
                                               ROOT / "benchmarks" / "time_to_quality.py")
ttq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttq)

SE = math.sqrt(0.85 * 0.15 / 6000)  # the held-out standard error near the surfaces' accuracies

# Held-out accuracy of (schedule, lr multiplier, remedy); the test surface prefers other
# multipliers and remedies in every cell.
HELD = {"BP": {0.5: 0.850, 1.0: 0.860, 2.0: 0.861, 4.0: 0.855},  # x2 within one SE: x1
        "DDG K=4": {0.5: 0.850, 1.0: 0.852, 2.0: 0.860, 4.0: 0.858},  # edge grows to x4: x2
        "FDG K=4": {0.5: 0.860, 1.0: 0.850, 2.0: 0.840, 0.25: 0.855},  # edge /2 tried: x0.5
        "FDG K=8": {0.5: 0.800, 1.0: 0.820, 2.0: 0.810}}
HELD_REMEDY = {("FDG K=4", "auto"): +3 * SE,      # beats plain by 3 SE: chosen
               ("FDG K=4", "beta 0.5"): +1 * SE,
               ("FDG K=8", "auto"): +0.5 * SE,    # less than one SE: plain stays
               ("FDG K=8", "beta 0.5"): -0.01}
TEST = {"BP": {0.25: 0.70, 0.5: 0.90, 1.0: 0.85, 2.0: 0.80},
        "DDG K=4": {0.25: 0.80, 0.5: 0.95, 1.0: 0.85, 2.0: 0.84, 4.0: 0.80},
        "FDG K=4": {0.5: 0.70, 1.0: 0.88, 2.0: 0.90, 4.0: 0.70},
        "FDG K=8": {0.25: 0.60, 0.5: 0.90, 1.0: 0.70, 2.0: 0.90}}
LONGER = 0.02  # a run of more epochs than the part's ends this much higher
TEST_REMEDY = {("FDG K=4", "auto"): -0.05, ("FDG K=4", "beta 0.5"): +0.10,
               ("FDG K=8", "auto"): -0.05, ("FDG K=8", "beta 0.5"): +0.10}
EXPECTED = {"BP": {"lr_mult": 1.0, "remedy": None},
            "DDG K=4": {"lr_mult": 2.0, "remedy": None},
            "FDG K=4": {"lr_mult": 0.5, "remedy": "auto"},
            "FDG K=8": {"lr_mult": 1.0, "remedy": None}}


def _protocol():
  p = ttq.load_protocol()
  return p


def _final(task) -> float:
  f, split = task["fields"], task["split"]
  schedule = next(s for s, v in PART["schedules"].items()
                  if v["algorithm"] == f["algorithm"] and v["num_stages"] == f["num_stages"])
  mult = round(f["learning_rate"] / PART["fields"]["learning_rate"], 6)
  remedy = next((r for r, v in PART["remedies"].get(schedule, {}).items()
                 if all(f.get(k) == x for k, x in v.items())), None)
  if split == "held_out":
    return HELD[schedule][mult] + HELD_REMEDY.get((schedule, remedy), 0.0)
  longer = LONGER if f["num_epochs"] > PART["fields"]["num_epochs"] else 0.0
  return (TEST[schedule][mult] + TEST_REMEDY.get((schedule, remedy), 0.0) + longer
          + 0.001 * f["seed"])


PART = _protocol()["parts"]["fashion_mlp"]


def _auto(task) -> dict:
  """What a real run of staleness=auto stores: what auto set (the library's table)."""
  resolved = ttq.auto_resolution(task)
  return {} if resolved is None else {"auto_resolved": resolved}


class FakeRunner:
  """Records from the surfaces: a linear climb from 0.5 to the final accuracy over the run's
  epochs (so a longer run reaches any level later in epochs, earlier in fractions)."""

  def __init__(self):
    self.records, self.calls = {}, []

  def __call__(self, tasks):
    for t in tasks:
      self.calls.append(t)
      if t["key"] in self.records:
        continue
      final, epochs = _final(t), t["fields"]["num_epochs"]
      curve = [{"epoch": e, "test_accuracy": 0.5 + (final - 0.5) * e / epochs,
                "test_loss": 1.0, "train_loss": 1.0, "wall_time": 0.0}
               for e in range(1, epochs + 1)]
      self.records[t["key"]] = {"key": t["key"], "diverged": False, "test_accuracy": final,
                                "test_loss": 1.0, "curve": curve, "split": t["split"],
                                "fields": t["fields"], "protocol_sha256": t["protocol_sha256"],
                                "what": t["what"], **_auto(t)}


def _study(protocol=None, runner=None):
  runner = runner or FakeRunner()
  return ttq.Study(protocol or _protocol(), "fashion_mlp", runner, runner.records), runner


def test_every_choice_follows_the_held_out_surface_and_the_tie_rule():
  study, runner = _study()
  assert study.select() == EXPECTED
  # Selection read held-out records only.
  assert all(t["split"] == "held_out" for t in runner.calls)
  assert any("BP: lr x2" in line for line in study.log)      # the lr tie went to x1
  assert any("FDG K=8: best remedy auto" in line for line in study.log)  # the remedy tie


def _choices_from_test(study):
  """The selection pointed at the test split, as a protocol bug would."""
  original = study.held_out

  def from_test(schedule, lr_mult, remedy=None):
    t = original(schedule, lr_mult, remedy)
    return study.task("test", schedule, lr_mult, remedy, study.spec["selection_seed"])
  study.held_out = from_test
  return study.select()


def _test_tasks(runner) -> list[str]:
  return [t["what"] for t in runner.calls if t["split"] != "held_out"]


def test_the_library_selection_is_not_what_selecting_on_test_records_gives():
  """The library's own selection (whatever it reads) against the choices that the test
  surface gives (the selection pointed at test tasks by hand, on a separate study): they
  differ in every cell, so a library that reads test records fails here."""
  study, runner = _study()
  chosen = study.select()
  assert not _test_tasks(runner), _test_tasks(runner)[:3]  # selection trains no test task
  peeked = _choices_from_test(_study()[0])
  for schedule in EXPECTED:
    assert chosen[schedule] != peeked[schedule], schedule


def test_report_metrics_from_known_curves():
  study, runner = _study()
  study.select()
  tests = study.test()
  assert set(tests) == set(EXPECTED)
  assert all(len(cell["equal"]) == 3 for cell in tests.values())
  assert "long" not in tests["BP"] and all(len(tests[s]["long"]) == 3 for s in EXPECTED
                                           if s != "BP")
  summary = ttq.summarise(study, tests)
  spe, epochs = 60000 // 128, PART["fields"]["num_epochs"]
  assert summary["steps_per_epoch"] == spe and summary["bp_steps"] == epochs * spe
  bp = statistics_mean([TEST["BP"][1.0] + 0.001 * s for s in (0, 1, 2)])
  assert summary["bp_final_accuracy"] == pytest.approx(100 * bp)
  rows = summary["rows"]
  # DDG K=4 at x2 ends at 0.84 + seed/1000, below BP; its 2x run ends LONGER higher, above
  # BP, and reaches BP's level at epoch 2E (bp - 0.5) / (final + LONGER - 0.5) of its climb.
  ddg_final = statistics_mean([TEST["DDG K=4"][2.0] + 0.001 * s for s in (0, 1, 2)])
  assert rows["DDG K=4"]["gap"] == pytest.approx(100 * (ddg_final - bp))
  long_epochs = int(round(PART["horizon_factor"] * epochs))
  expected = long_epochs * (bp - 0.5) / (ddg_final + LONGER - 0.5) / epochs
  assert 1.0 < expected < 2.0
  assert rows["DDG K=4"]["step_overhead"] == pytest.approx(expected)
  assert rows["DDG K=4"]["time_to_quality_speedup"] == pytest.approx(
      rows["DDG K=4"]["predicted_speedup"] / expected)
  # FDG K=4 with its chosen remedy ends at 0.70 - 0.05 (+ LONGER): never reaches BP's level.
  assert rows["FDG K=4"]["step_overhead"] is None
  assert 1.0 < rows["FDG K=8"]["predicted_speedup"] <= 8.0
  text = ttq.markdown("fashion_mlp", summary, study.log)
  assert "not reached in" in text and f"{expected:.2f}×" in text
  # Where BP's level is not reached, the table says how close the longer run came: its
  # climb ends at its last evaluation, the mean of its runs' final accuracies.
  long_runs = tests["FDG K=4"]["long"]
  high = rows["FDG K=4"]["long_highest"]
  assert high[0] == long_epochs * spe
  assert high[1] == pytest.approx(100 * statistics_mean([r["test_accuracy"] for r in long_runs]))
  assert f"not reached in {long_epochs * spe} steps (highest {high[1]:.2f}, step {high[0]})" \
      in text and "Not reached:" in text


def statistics_mean(xs):
  return sum(xs) / len(xs)


def test_steps_to_reach_interpolates_and_says_never():
  curve = [(100, 0.5), (200, 0.7), (300, 0.9)]
  assert ttq.steps_to_reach(curve, 0.8) == pytest.approx(250)
  assert ttq.steps_to_reach(curve, 0.4) == 100
  assert ttq.steps_to_reach(curve, 0.95) is None


def test_records_of_another_protocol_version_are_refused():
  study, runner = _study()
  study.select()
  changed = copy.deepcopy(_protocol())
  changed["parts"]["fashion_mlp"]["lr_grid"] = [0.5, 1.0, 2.0, 4.0]
  other, _ = _study(changed, runner)
  with pytest.raises(ttq.ProtocolError, match="another version of part 'fashion_mlp'"):
    other.select()


def test_a_missing_record_is_refused_in_report_mode():
  study, runner = _study()
  study.select()
  records = dict(runner.records)
  records.pop(next(iter(records)))
  reader = ttq.ReadOnly(records)
  with pytest.raises(ttq.ProtocolError, match="have no record"):
    ttq.Study(_protocol(), "fashion_mlp", reader, records).select()


def test_the_config_key_covers_every_field():
  study, _ = _study()
  a = study.task("test", "FDG K=4", 1.0, None, 0)
  b = study.task("test", "FDG K=4", 1.0, None, 0, epochs_factor=2.0)
  assert a["key"] != b["key"] and b["fields"]["num_epochs"] == 2 * a["fields"]["num_epochs"]
  c = study.task("held_out", "FDG K=4", 1.0, None, 0)
  assert c["key"] != a["key"] and c["fields"] == a["fields"]


def test_parts_not_run_are_refused():
  with pytest.raises(ttq.ProtocolError, match="not run under this protocol"):
    ttq.Study(_protocol(), "fashion_vit", FakeRunner(), {})


RESULT = ROOT / "docs" / "results" / "time_to_quality_fashion_mlp.json"
DOCS = ROOT / "docs" / "staleness.md"
RESULTS = ROOT / "docs" / "results.md"


@functools.lru_cache(maxsize=None)
def _report(*flags: str, part: str = "fashion_mlp") -> str:
  """What `time_to_quality.py --part PART --report FLAGS` prints (asserted to succeed)."""
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_to_quality.py"),
                        "--part", part, "--report", *flags],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  return out.stdout.strip()


@pytest.mark.skipif(not RESULT.exists(), reason="the part has not been run")
def test_the_docs_table_is_what_the_report_prints_from_the_committed_json():
  table = _report("--markdown")
  assert table.startswith("<!-- time_to_quality fashion_mlp")
  assert table in DOCS.read_text(), "docs/staleness.md's table differs from the report"
  assert table in RESULTS.read_text(), "docs/results.md's table differs from the report"


# ------------------------------------------------------------------------------ gpt_long
# The GPT part chooses by held-out *loss* (lower is better), its tie margin the record's own
# standard error, and runs a second round of remedies (pairs of round-1 winners).
GPT = _protocol()["parts"]["gpt_long"]
GSE = 0.01  # every held-out record's test_loss_se
G_HELD = {"BP": {0.5: 1.30, 1.0: 1.20, 2.0: 1.195, 4.0: 1.25},  # x2 within one SE: x1
          "DDG K=4": {0.5: 1.40, 1.0: 1.35, 2.0: 1.30, 4.0: 1.32},  # edge x4 tried: x2
          "FDG K=4": {0.5: 1.40, 1.0: 1.45, 2.0: 1.50, 0.25: 1.42},  # x0.5
          "FDG K=8": {0.5: 1.60, 1.0: 1.55, 2.0: 1.70}}
# Round 1, relative to the plain run at the chosen lr (negative: better).
G_HELD_REMEDY = {("DDG K=4", "auto"): -0.005,                   # within one SE: plain
                 ("FDG K=4", "auto"): -0.05, ("FDG K=4", "warmup 1/3"): -0.03,
                 ("FDG K=4", "weight_prediction"): -0.04,
                 ("FDG K=8", "error_feedback 1"): -0.10, ("FDG K=8", "weight_prediction"): -0.02}
# Round 2 pairs, relative to the plain run.
G_HELD_PAIR = {("FDG K=4", "auto & warmup 1/3"): -0.07,         # beats auto by 2 SE: chosen
               ("FDG K=8", "error_feedback 1 & weight_prediction"): -0.105}  # by < 1 SE
G_EXPECTED = {"BP": {"lr_mult": 1.0, "remedy": None},
              "DDG K=4": {"lr_mult": 2.0, "remedy": None},
              "FDG K=4": {"lr_mult": 0.5, "remedy": "auto & warmup 1/3"},
              "FDG K=8": {"lr_mult": 1.0, "remedy": "error_feedback 1"}}
# The test surface prefers other choices everywhere: (schedule, mult, remedy) -> final loss
# at the selection horizon; longer runs end lower.
G_TEST = {"BP": {0.5: 1.10, 1.0: 1.20, 2.0: 1.30}, "DDG K=4": {1.0: 1.20, 2.0: 1.15, 4.0: 1.10},
          "FDG K=4": {0.25: 1.20, 0.5: 1.50, 1.0: 1.25},
          "FDG K=8": {0.5: 1.30, 1.0: 1.60, 2.0: 1.4}}


def _gpt_schedule_and_remedy(f):
  schedule = next(s for s, v in GPT["schedules"].items()
                  if v["algorithm"] == f["algorithm"] and v["num_stages"] == f["num_stages"])
  mult = round(f["learning_rate"] / (GPT["fields"]["learning_rate"]
                                     * GPT["lr_base"][schedule]), 6)
  names = []
  for name, r in GPT["remedies"].get(schedule, {}).items():
    fields = {k: v for k, v in r.items() if k != "fractions"}
    st = fields.pop("staleness", None)
    fractions_ok = all(abs(f.get(k, -1) - v * f["num_epochs"]) < 1e-9
                       for k, v in r.get("fractions", {}).items())
    if (fractions_ok and all(f.get(k) == v for k, v in fields.items())
        and (st is None or st in f["staleness"].split("+"))):
      names.append(name)
  return schedule, mult, " & ".join(names) or None


class FakeLossRunner(FakeRunner):
  def __call__(self, tasks):
    for t in tasks:
      self.calls.append(t)
      if t["key"] in self.records:
        continue
      f = t["fields"]
      schedule, mult, remedy = _gpt_schedule_and_remedy(f)
      if t["split"] == "held_out":
        final = (G_HELD[schedule][mult] + G_HELD_REMEDY.get((schedule, remedy), 0.0)
                 + G_HELD_PAIR.get((schedule, remedy), 0.0))
      else:
        final = (G_TEST[schedule].get(mult, 2.0) + (0.3 if remedy else 0.0)
                 - 0.05 * math.log2(f["num_epochs"]) + 0.001 * f["seed"])
      steps = f["num_epochs"] * 1500
      curve = [{"epoch": s / 1500, "step": s, "test_loss": 3.0 + (final - 3.0) * s / steps,
                "test_accuracy": 0.0, "train_loss": 1.0, "wall_time": 0.0}
               for s in range(250, steps + 1, 250)]
      self.records[t["key"]] = {"key": t["key"], "diverged": False, "test_accuracy": 0.0,
                                "test_loss": final, "test_loss_se": GSE, "curve": curve,
                                "split": t["split"], "fields": f, "what": t["what"],
                                "protocol_sha256": t["protocol_sha256"], **_auto(t)}


def _gpt_study(runner=None):
  runner = runner or FakeLossRunner()
  return ttq.Study(_protocol(), "gpt_long", runner, runner.records), runner


def test_gpt_choices_by_held_out_loss_with_pairs_and_the_tie_rule():
  study, runner = _gpt_study()
  assert study.select() == G_EXPECTED
  assert all(t["split"] == "held_out" for t in runner.calls)
  assert all(t["fields"]["num_epochs"] == GPT["selection_epochs"] for t in runner.calls)
  assert any(line.startswith("BP: lr x2") for line in study.log)
  assert any(line.startswith("DDG K=4: best remedy auto") for line in study.log)
  assert any(line.startswith("FDG K=8: best pair") for line in study.log)
  # Pairs never join auto with a candidate that sets more than a warm-up.
  assert not any("auto & lr scale" in t["what"] or "auto & error" in t["what"]
                 for t in runner.calls)


def test_the_library_gpt_selection_is_not_what_selecting_on_test_records_gives():
  study, runner = _gpt_study()
  chosen = study.select()
  assert not _test_tasks(runner), _test_tasks(runner)[:3]
  peeked = _choices_from_test(_gpt_study()[0])
  for schedule in G_EXPECTED:
    assert chosen[schedule] != peeked[schedule], schedule


def test_gpt_horizons_overhead_and_auto_rows():
  study, runner = _gpt_study()
  study.select()
  tests = study.test()
  assert set(tests["BP"]) == {"equal@1", "equal@2", "equal@4"}
  assert set(tests["DDG K=4"]) == {"equal@1", "equal@2", "equal@4", "long@1", "long@2",
                                   "long@4", "auto@4"}
  assert "auto@4" in tests["FDG K=8"] and "auto@4" in tests["FDG K=4"]
  assert all(r["fields"]["eval_every_steps"] == 250 for cell in tests.values()
             for runs in cell.values() for r in runs)
  assert [r["fields"]["num_epochs"] for r in tests["FDG K=8"]["long@2"]] == [4, 4]
  summary = ttq.summarise_horizons(study, tests)
  block = summary["horizons"]["2"]
  bp_loss = statistics_mean([1.20 - 0.05 * 1 + 0.001 * s for s in (0, 1)])
  assert block["bp_loss"] == pytest.approx(bp_loss) and block["bp_steps"] == 3000
  # DDG K=4 (x2, plain): its 4-epoch run ends at 1.15 - 0.10 (+ seed); linear from 3.0 over
  # 6,000 steps, it falls to BP's loss at 6000 (3 - bp) / (3 - final).
  final = statistics_mean([1.15 - 0.10 + 0.001 * s for s in (0, 1)])
  expected = 6000 * (3.0 - bp_loss) / (3.0 - final) / 3000
  assert block["rows"]["DDG K=4"]["step_overhead"] == pytest.approx(expected, rel=1e-6)
  assert 1.0 < expected < 2.0
  ppl = statistics_mean([math.exp(1.15 - 0.05 + 0.001 * s) for s in (0, 1)])
  bp_ppl = statistics_mean([math.exp(1.20 - 0.05 + 0.001 * s) for s in (0, 1)])
  assert block["rows"]["DDG K=4"]["gap"] == pytest.approx(ppl / bp_ppl - 1)
  # Where BP's loss is not reached, the row carries the longer run's lowest mean loss (as a
  # perplexity) and its step, read from the records.
  missed = [(h, s, r) for h, b in summary["horizons"].items() for s, r in b["rows"].items()
            if s != "BP" and r["step_overhead"] is None]
  assert missed
  for h, schedule, r in missed:
    runs = tests[schedule][f"long@{h}"]
    by_step = {}
    for run in runs:
      for p in run["curve"]:
        by_step.setdefault(p["step"], []).append(p["test_loss"])
    step, loss = min(((k, statistics_mean(v)) for k, v in by_step.items()
                      if len(v) == len(runs)), key=lambda kv: kv[1])
    assert r["long_lowest"] == (step, pytest.approx(math.exp(loss)))
  assert summary["auto"]["DDG K=4"]["steps"] == 6000
  text = ttq.markdown_horizons("gpt_long", summary, study.log)
  assert "| 3000 | DDG K=4 | lr ×2 |" in text and "`staleness=auto`" in text
  # What auto set, from the records: in the chosen column and in the auto rows.
  fdg4 = "(auto: error_feedback, staleness_strength 1, warmup_epochs 1.3332)"
  assert f"| 6000 | FDG K=4 | lr ×0.5, auto & warmup 1/3 {fdg4} |" in text
  ddg4 = "(auto: error_feedback+weight_prediction, staleness_strength 1)"
  assert f"| 6000 | DDG K=4, `staleness=auto` | lr ×2, auto {ddg4} |" in text
  # A run of auto that trained other fields than auto sets now is labelled so.
  runs = tests["DDG K=4"]["auto@4"]
  for r in runs:
    r["auto_resolved"] = {"staleness": "error_feedback", "staleness_strength": 0.5}
  report = ttq.Study(_protocol(), "gpt_long", ttq.ReadOnly(runner.records), runner.records)
  report.select()
  text = ttq.markdown_horizons("gpt_long", ttq.summarise_horizons(report, report.test()),
                               report.log)
  assert ("| 6000 | DDG K=4, `staleness=auto` as it was | lr ×2, auto (auto: error_feedback, "
          "staleness_strength 0.5) |") in text


def _row(table: str, schedule: str) -> str:
  return next(line for line in table.splitlines() if line.startswith(f"| {schedule} |"))


def test_the_auto_rows_are_refused_unless_auto_is_the_parts_choice_then_quote_its_runs(
    monkeypatch):
  """The report's auto table: refused while `fdg_jax.optim.auto.STUDY` is not the part's
  held-out choice (the fake part chose otherwise than the committed one); with STUDY made the
  derived row, each delayed schedule's line is what auto sets and its chosen runs' figures."""
  from fdg_jax.optim import auto
  study, runner = _gpt_study()
  study.select()
  summary = ttq.summarise_horizons(study, study.test())
  with pytest.raises(ttq.ProtocolError, match="make fdg_jax/optim/auto.py's STUDY"):
    ttq.auto_markdown(study, summary)
  derived = ttq.derive_auto(study)
  # G_EXPECTED over BP's x1, each on its schedule's lr_base: DDG K=4 plain at x2, FDG K=8
  # error_feedback 1 at x1.
  base = GPT.get("lr_base", {})
  assert derived.cells[("ddg", 4)] == auto.Choice(
      2.0 * base.get("DDG K=4", 1.0) / base.get("BP", 1.0), {}, {})
  assert derived.cells[("fdg", 8)].lr_mult == base.get("FDG K=8", 1.0) / base.get("BP", 1.0)
  assert dict(derived.cells[("fdg", 8)].fields) == {"staleness": "error_feedback",
                                                    "staleness_strength": 1.0}
  assert dict(derived.cells[("fdg", 4)].fractions) == {"warmup_epochs": 0.3333}  # protocol
  rows = [r for r in auto.STUDY if r.part != "gpt_long"]
  monkeypatch.setattr(auto, "STUDY", (*rows, derived))
  assert ttq.auto_mismatch(study) is None
  table = ttq.auto_markdown(study, summary)
  assert "| test perplexity at 6000 steps" in table.splitlines()[1]
  block = summary["horizons"]["4"]["rows"]
  for schedule in ("DDG K=4", "FDG K=4", "FDG K=8"):
    r = block[schedule]
    assert _row(table, schedule).endswith(
        f"| {r['ppl']:.3f} ± {r['ppl_std']:.3f} | {100 * r['gap']:+.1f}% |"), schedule
  assert _row(table, "DDG K=4").startswith(
      f"| DDG K=4 | lr ×{derived.cells[('ddg', 4)].lr_mult:g}, no remedy | lr ")
  assert "`error_feedback, staleness_strength 1`" in _row(table, "FDG K=8")
  # a cell of STUDY changed by hand: refused again, naming it
  cells = {**derived.cells, ("fdg", 8): auto.Choice(0.5, {}, {})}
  monkeypatch.setattr(auto, "STUDY", (*rows, dataclasses.replace(derived, cells=cells)))
  assert "at ('fdg', 8)" in ttq.auto_mismatch(study)


def test_steps_to_fall_to_a_loss():
  curve = [(100, 3.0), (200, 2.0), (300, 1.0)]
  assert ttq.steps_to_fall_to(curve, 1.5) == pytest.approx(250)
  assert ttq.steps_to_fall_to(curve, 0.5) is None


README = ROOT / "README.md"


@pytest.mark.skipif(not RESULT.exists(), reason="the part has not been run")
def test_the_docs_auto_table_is_what_the_report_prints_from_the_committed_json():
  table = _report("--auto_markdown")
  assert table.startswith("<!-- time_to_quality fashion_mlp auto")
  # The three delayed cells: two chose no remedy (both columns), K=8 what auto set then.
  assert all(f"| {s} |" in table for s in ("DDG K=4", "FDG K=4", "FDG K=8"))
  assert table.count("no remedy |") == 4 and "`spike_compensation+weight_prediction`" in table
  assert table in DOCS.read_text(), "docs/staleness.md's auto table differs from the report"


def test_status_names_the_next_batch_and_never_trains():
  """--status walks the protocol over the records so far: the choices made, then the first
  batch without records (the study's next runs); complete once every run has a record."""
  full, runner = _study()
  full.select()
  full.test()
  records = dict(runner.records)
  # Drop the records of FDG K=4's remedy candidates: BP and DDG K=4 are chosen, FDG K=4's
  # learning rate is, and the next batch is those candidates (and the plain run is kept).
  remedy_keys = {full.held_out("FDG K=4", 0.5, r)["key"] for r in PART["remedies"]["FDG K=4"]}
  partial = {k: v for k, v in records.items() if k not in remedy_keys}
  text = ttq.status(ttq.Study(_protocol(), "fashion_mlp", ttq.Planner(partial), partial))
  assert "chosen BP: lr x1, no remedy" in text and "chosen DDG K=4: lr x2, no remedy" in text
  assert "chosen FDG K=4" not in text
  assert f"next (selection): {len(remedy_keys)} run(s)" in text
  assert "held_out FDG K=4 lr x0.5 auto seed 0" in text
  assert "held_out FDG K=4 lr x0.5 beta 0.5 seed 0" in text
  # No test record: the test phase is the one batch left, every chosen setting's runs.
  held = {k: v for k, v in records.items() if v["split"] == "held_out"}
  text = ttq.status(ttq.Study(_protocol(), "fashion_mlp", ttq.Planner(held), held))
  tests = [r for r in records.values() if r["split"] == "test"]
  assert f"next (test): {len(tests)} run(s) (the last batch)" in text
  assert "chosen FDG K=8: lr x1, no remedy" in text
  text = ttq.status(ttq.Study(_protocol(), "fashion_mlp", ttq.Planner(records), records))
  assert text.endswith("--report prints it") and "next" not in text


def test_a_run_two_cells_share_is_planned_and_trained_once_shortest_first(tmp_path):
  """A horizon h's long run is horizon 2h's equal run: same config, same key. The pending
  batch holds it once, ordered by epochs; --status counts it once."""
  study, runner = _gpt_study()
  study.select()
  tasks = [t for cell in study.test_tasks().values() for ts in cell.values() for t in ts]
  keys = [t["key"] for t in tasks]
  assert len(set(keys)) < len(keys)  # the protocol's cells do share runs
  todo = ttq.pending(tasks, runner.records)
  assert sorted(t["key"] for t in todo) == sorted(set(keys))
  epochs = [t["fields"]["num_epochs"] for t in todo]
  assert epochs == sorted(epochs) and epochs[0] == 1 and epochs[-1] == 8
  held = dict(runner.records)
  text = ttq.status(ttq.Study(_protocol(), "gpt_long", ttq.Planner(held), held))
  assert f"next (test): {len(set(keys))} run(s)" in text
  steps = sum(t["fields"]["num_epochs"] for t in todo) * ttq.text_steps_per_epoch(GPT)
  assert f"{steps:,} steps" in text
  # The runner itself: each shared run is trained (submitted) once.
  submitted = []

  class Pool:
    def submit(self, fn, task):
      submitted.append(task["key"])
      fut = concurrent.futures.Future()
      fut.set_result({"diverged": False, "test_loss": 1.0, "test_accuracy": 0.0,
                      "wall_time": 0.0, "curve": []})
      return fut

  out = tmp_path / "records.json"
  run = ttq.Runner(out, tmp_path, jobs=1)
  run.pool = Pool()
  run(tasks)
  assert sorted(submitted) == sorted(set(keys))
  assert set(json.loads(out.read_text())["records"]) == set(keys)


def test_auto_runs_of_another_auto_table_are_reported_as_they_ran_but_never_extended():
  """The config key names "auto", not what it set: a record stores what auto set. A report
  reads it as that; a study refuses to add a run of an auto candidate that has records of
  another table than auto's now (one name, two tables), and adds any other run."""
  study, runner = _gpt_study()
  study.select()
  study.test()
  task = study.task("held_out", "DDG K=4", 2.0, "auto", GPT["selection_seed"])
  record = runner.records[task["key"]]
  assert record["auto_resolved"] == ttq.auto_resolution(task) and record["auto_resolved"]
  assert not study.stale_auto()
  record["auto_resolved"] = {"staleness": "error_feedback", "staleness_strength": 0.25}
  report = ttq.Study(_protocol(), "gpt_long", ttq.ReadOnly(runner.records), runner.records)
  assert report.select() == G_EXPECTED  # the held-out selection reads it as it ran
  assert report.stale_auto() == [task["what"]]
  # A missing run of another candidate is trained; a batch with one of DDG K=4's auto is not.
  bp = study.task("test", "BP", 1.0, None, 0, epochs=1)
  del runner.records[bp["key"]]
  resumed = ttq.Study(_protocol(), "gpt_long", runner, runner.records)
  resumed.select()
  resumed.test()
  assert bp["key"] in runner.records
  auto4 = study.task("test", "DDG K=4", 2.0, "auto", 1, epochs=4)
  del runner.records[bp["key"]], runner.records[auto4["key"]]
  runner.calls.clear()
  resumed = ttq.Study(_protocol(), "gpt_long", runner, runner.records)
  resumed.select()
  with pytest.raises(ttq.ProtocolError, match="1 run.* DDG K=4 lr x2 auto seed 1 4 epochs.*"
                                              "another auto table"):
    resumed.test()
  assert not [t for t in runner.calls if t["split"] == "test"]  # refused before training
  status = ttq.status(ttq.Study(_protocol(), "gpt_long", ttq.Planner(runner.records),
                                runner.records))
  assert "1 staleness=auto record(s) made under another auto table" in status
  del record["auto_resolved"]  # a record that does not say what auto set: refused
  with pytest.raises(ttq.ProtocolError, match="does not say what auto set"):
    ttq.Study(_protocol(), "gpt_long", ttq.ReadOnly(runner.records), runner.records).select()


GPT_RESULT = ROOT / "docs" / "results" / "time_to_quality_gpt_long.json"


def _gpt_long_complete() -> bool:
  """Whether every run gpt_long's protocol needs has a record (what --status says)."""
  if not GPT_RESULT.exists():
    return False
  records = json.loads(GPT_RESULT.read_text())["records"]
  study = ttq.Study(_protocol(), "gpt_long", ttq.Planner(records), records)
  return ttq.status(study).splitlines()[-1].startswith("complete")


@pytest.mark.skipif(not _gpt_long_complete(), reason="gpt_long's runs are not all recorded")
def test_the_gpt_long_docs_table_is_what_the_report_prints_from_the_committed_json():
  table = _report("--markdown", part="gpt_long")
  assert table.startswith("<!-- time_to_quality gpt_long")
  assert table in DOCS.read_text(), "docs/staleness.md's gpt_long table differs from the report"
  assert table in RESULTS.read_text(), "docs/results.md's gpt_long table differs from the report"


@pytest.mark.skipif(not _gpt_long_complete(), reason="gpt_long's runs are not all recorded")
def test_the_docs_gpt_auto_table_is_what_the_report_prints_from_the_committed_json():
  table = _report("--auto_markdown", part="gpt_long")
  assert table.startswith("<!-- time_to_quality gpt_long auto")
  assert all(f"| {s} |" in table for s in ("DDG K=4", "FDG K=4", "FDG K=8"))
  assert table in DOCS.read_text(), "docs/staleness.md's gpt_long auto table differs"


def test_an_interrupted_run_resumes_from_its_checkpoint_to_the_same_record(tmp_path):
  import shutil
  from fdg_jax import trainer
  base = ttq.load_config(str(ROOT / "configs" / "default.py"))
  base.model_kwargs.widths = (16, 16, 16)
  fields = dict(algorithm="fdg", num_stages=4, batch_size=128, num_epochs=2, momentum=0.9,
                checkpoint_every_steps=4, staleness="auto", warmup_epochs=0.0)
  assert "learning_rate" in trainer.auto_fields(ttq.with_fields(base, **fields))[0]  # it sets
  whole = ttq.run_one(base, str(tmp_path / "whole"), "k", resume=True, **fields)
  assert "resumed_from_step" not in whole
  import jax
  assert whole["env"]["jax"] == jax.__version__ and whole["env"]["cores"] >= 1  # what it ran on
  # An interrupted run: the same config, its newest checkpoint not yet written.
  shutil.copytree(tmp_path / "whole" / "k", tmp_path / "cut" / "k")
  ckpts = tmp_path / "cut" / "k" / trainer.CHECKPOINT_DIR
  steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
  shutil.rmtree(ckpts / str(steps[-1]))
  resumed = ttq.run_one(base, str(tmp_path / "cut"), "k", resume=True, **fields)
  assert resumed["resumed_from_step"] == steps[-2] < steps[-1]
  strip = lambda r: [{k: v for k, v in c.items() if k != "wall_time"} for c in r["curve"]]
  assert resumed["test_loss"] == whole["test_loss"] and strip(resumed) == strip(whole)
  # Another config (or resume off) never goes on from the finished run's checkpoints.
  other = ttq.run_one(base, str(tmp_path / "cut"), "k", resume=True, **{**fields, "seed": 1})
  assert "resumed_from_step" not in other and other["test_loss"] != whole["test_loss"]
  fresh = ttq.run_one(base, str(tmp_path / "whole"), "k", **fields)
  assert "resumed_from_step" not in fresh and strip(fresh) == strip(whole)


def test_a_pool_worker_whose_study_is_gone_exits_after_its_run(monkeypatch):
  import os
  exits = []
  monkeypatch.setattr(ttq.os, "_exit", exits.append)
  monkeypatch.delitem(ttq._PARENT, "pid", raising=False)
  ttq._exit_if_orphaned()  # not a pool worker: nothing
  monkeypatch.setitem(ttq._PARENT, "pid", os.getppid())
  ttq._exit_if_orphaned()  # its study is there
  assert exits == []
  monkeypatch.setitem(ttq._PARENT, "pid", os.getppid() + 1)  # the study it started under
  ttq._exit_if_orphaned()
  assert exits == [0]


def _readme_bullets(title: str) -> list[str]:
  """The README's results bullets that start with `- **TITLE`, each as one line of text."""
  bullets, current = [], None
  for line in README.read_text().splitlines():
    if line.startswith("- "):
      current = [line] if line.startswith(f"- **{title}") else None
      if current is not None:
        bullets.append(current)
    elif current is not None and line.startswith("  "):
      current.append(line.strip())
    else:
      current = None
  return [" ".join(b) for b in bullets]


def test_the_readme_time_to_quality_figures_are_the_reports():
  """Every decimal figure the README's time-to-quality bullets quote after their set-up
  (the first parenthesis) is in what the report prints from the committed JSON for that
  bullet's part: the prose is written by hand, its figures must not be."""
  import re
  bullets = _readme_bullets("Time to BP's quality")
  assert bullets, "README has no time-to-quality bullet"
  parts = {"Fashion-MNIST": "fashion_mlp", "GPT": "gpt_long"}
  checked = 0
  for bullet in bullets:
    part = next(p for name, p in parts.items() if name in bullet.split(")")[0])
    if part == "gpt_long" and not _gpt_long_complete():
      continue
    report = _report("--markdown", part=part) + "\n" + _report("--auto_markdown", part=part)
    for figure in re.findall(r"[-−+]?\d+\.\d+", bullet.split(")", 1)[1]):
      assert figure.replace("−", "-") in report, f"README quotes {figure} ({part}): not in report"
      checked += 1
  assert checked >= 4


def test_a_run_that_fails_stops_the_study_and_enters_no_record(tmp_path, monkeypatch):
  """A missing dataset is an infrastructure failure, not a divergence: the real runner's
  worker raises, the study stops with that one line, and the part's JSON gets no record
  (before, each such run was stored as diverged and scored -inf by the selection)."""
  monkeypatch.setitem(sys.modules, "time_to_quality", ttq)  # the pool pickles its functions
  protocol = _protocol()
  part = protocol["parts"]["fashion_mlp"]
  part["fields"].update(dataset="mnist", data_dir=str(tmp_path / "missing"), num_epochs=1)
  out = tmp_path / "part.json"
  runner = ttq.Runner(out, tmp_path / "runs", jobs=1)
  try:
    study = ttq.Study(protocol, "fashion_mlp", runner, runner.records)
    with pytest.raises(ttq.RunFailed) as info:
      study.select()
  finally:
    runner.close()
  message = str(info.value)
  assert message.startswith("held_out BP lr x0.5 plain seed 0 failed: DatasetNotFoundError")
  assert "\n" not in message and "no record was kept" in message
  assert runner.records == {} and not out.exists()


@pytest.mark.parametrize("part", ["fashion_mlp", "gpt_long"])
def test_the_targets_of_a_run_part_are_in_the_protocol_and_judged_from_its_records(part):
  spec = ttq.load_protocol()["parts"][part]
  assert spec["targets"] and "targets_source" in spec
  got = json.loads(_report("--targets_json", part=part))
  summary = json.loads((ROOT / "docs" / "results" / f"time_to_quality_{part}.json")
                       .read_text())["summary"]
  if "horizons" in summary:  # judged at the longest horizon
    summary = summary["horizons"][str(max(spec["horizons"]))]
  assert [g["target"] for g in got] == [t["target"] for t in spec["targets"]]
  for g, t in zip(got, spec["targets"]):
    kind, _, cell = t["quantity"].partition(" ")
    value = summary["rows"][cell][kind]
    assert g["value"] == value and g["bound"] == t["bound"]
    if value is None:  # never reached: missed, whatever the bound
      assert g["met"] is False and "not reached" in g["note"]
    else:
      assert g["met"] == (value >= t["bound"] if t["sense"] == ">=" else value <= t["bound"])
  # Judging nothing new: the targets are not part of what the runs trained.
  bare = copy.deepcopy(ttq.load_protocol())
  for key in ttq.REPORT_ONLY:
    bare["parts"][part].pop(key, None)
  assert ttq.part_sha256(bare, part) == ttq.part_sha256(ttq.load_protocol(), part)


def test_the_gpt_targets_are_met_only_by_ddg_k4s_gap():
  got = json.loads(_report("--targets_json", part="gpt_long"))
  assert [g["target"].split(" ")[0:2] for g in got if g["met"]] == [["DDG", "K=4"]]
  assert [g for g in got if g["met"]][0]["target"].startswith("DDG K=4 equal-step")


def _what_the_worker_evaluates_on(task, tmp_path, monkeypatch, load):
  """Runs the study's real worker on `task` with the training replaced by `load`, which sees
  the data the trainer would read at that moment (inside whatever the worker set up)."""
  seen = {}

  def spy(config, workroot, key, **fields):
    seen.update(load({**config.to_dict(), **fields}))
    return {"key": key, "diverged": False, "test_accuracy": 0.5, "test_loss": 1.0,
            "curve": []}
  monkeypatch.setattr(ttq, "run_one", spy)
  ttq._worker({**task, "workroot": str(tmp_path)})
  return seen


def _rows(ds) -> set[bytes]:
  import numpy as np
  images, labels = ds.read(np.arange(ds.num_examples))
  return {im.tobytes() + bytes([int(lb)]) for im, lb in zip(images, labels)}


def test_a_held_out_image_run_evaluates_on_training_examples_never_on_test(tmp_path,
                                                                          monkeypatch):
  from fdg_jax import data
  study, _ = _study()
  task = study.held_out("BP", 1.0)
  assert task["split"] == "held_out"
  got = _what_the_worker_evaluates_on(task, tmp_path, monkeypatch, lambda c: {
      "eval": _rows(data.load(c["dataset"], "test", c["data_dir"] or None)),
      "train": _rows(data.load(c["dataset"], "train", c["data_dir"] or None))})
  real_test = _rows(data.load(PART["fields"]["dataset"], "test"))
  real_train = _rows(data.load(PART["fields"]["dataset"], "train"))
  # By content: the evaluation rows are training rows (a few of Fashion-MNIST's images occur
  # in both of its splits), the held-out fraction of them, none of those the run trains on.
  assert len(got["eval"] & real_test) < 0.01 * len(got["eval"])
  assert got["eval"] <= real_train and not got["eval"] & got["train"]
  assert abs(len(got["eval"]) - 0.1 * len(real_train)) < 0.01 * len(real_train)


def test_a_held_out_text_run_evaluates_on_training_bytes_it_never_trains_on(tmp_path,
                                                                           monkeypatch):
  import numpy as np
  from fdg_jax.data import text
  study, _ = _gpt_study()
  task = study.held_out("BP", 1.0)
  got = _what_the_worker_evaluates_on(task, tmp_path, monkeypatch, lambda c: {
      "eval": text.load_text("validation", seq_len=c["seq_len"],
                             max_bytes=c.get("text_max_bytes") or None).tokens.copy(),
      "train": text.load_text("train", seq_len=c["seq_len"],
                              max_bytes=c.get("text_max_bytes") or None).tokens.copy()})
  offset = GPT["held_out"]["text_offset"]
  size = GPT["held_out"]["text_bytes"]
  corpus = text.load_text("train", seq_len=64, max_bytes=offset + size).tokens
  assert len(got["train"]) <= offset  # trained on the bytes before the held-out ones
  assert np.array_equal(got["eval"], corpus[offset:offset + size])
  real = text.load_text("validation", seq_len=64).tokens
  assert len(got["eval"]) != len(real) or not np.array_equal(got["eval"], real)
