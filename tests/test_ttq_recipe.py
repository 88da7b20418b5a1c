"""The fixed-recipe part of the time-to-quality study (benchmarks/ttq_recipe.py).

The pilot's plateau rule and the horizon rule on hand-made curves; the report's numbers from
records whose curves are known in closed form (the independent reference is the arithmetic
in each test); and a real study of two tiny runs, one pinned to a core and one as two
pinned processes, whose failure on a missing dataset stops the study with no record.
"""

import copy
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("ttq_recipe", ROOT / "benchmarks" / "ttq_recipe.py")
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)

PROTOCOL = json.loads((ROOT / "benchmarks" / "protocols" / "time_to_quality.json").read_text())


def _with_horizon(h: int = 20) -> dict:
  p = copy.deepcopy(PROTOCOL)
  spec = p["parts"]["fashion_resnet"]
  spec.update(status="run")
  spec["fields"]["num_epochs"] = h
  return p


def test_plateau_rule_on_known_curves():
  # A climb of 2 points an epoch to epoch 8, then flat: m(e) stops rising at e = 10 (the
  # 3-epoch mean of 8, 9, 10 is the plateau), and the rule asks for 6 epochs after it.
  climb = [0.80 + 0.02 * min(e, 8) for e in range(1, 21)]
  assert rec.plateau_epoch(climb) == 10
  # Still rising by 0.1 point an epoch: 6 epochs later the mean is 0.6 points higher, so
  # no epoch qualifies and P is the pilot's length.
  assert rec.plateau_epoch([0.8 + 0.001 * e for e in range(1, 31)]) == 30
  # 0.04 point an epoch: 0.24 points within 6 epochs, under the 0.25 bound from the start.
  assert rec.plateau_epoch([0.8 + 0.0004 * e for e in range(1, 31)]) == 3


def test_horizon_rule():
  spec = PROTOCOL["parts"]["fashion_resnet"]
  assert [rec.horizon(spec, p) for p in (3, 6, 7, 9, 10, 15, 30)] == [12, 12, 16, 20, 20, 32, 32]
  assert rec.milestones(spec, 20) == [10.0, 15.0, 18.4]


def test_pilot_is_held_out_and_test_runs_carry_the_recipe():
  p = _with_horizon(20)
  pilot = rec.pilot_task(PROTOCOL, "fashion_resnet")
  assert pilot["split"] == "held_out" and pilot["fields"]["lr_schedule"] == "constant"
  # Writing the horizon into the part leaves the pilot's version (and key) as it was.
  assert rec.pilot_task(p, "fashion_resnet") == pilot
  tasks = rec.cell_tasks(p, "fashion_resnet")
  for name, ts in tasks.items():
    cell = p["parts"]["fashion_resnet"]["cells"][name]
    assert [t["fields"]["seed"] for t in ts] == cell["seeds"]
    for t in ts:
      f = t["fields"]
      assert t["split"] == "test" and f["num_epochs"] == 20
      assert (f["learning_rate"], f["momentum"], f["weight_decay"]) == (0.1, 0.9, 0.0005)
      assert f["lr_milestones"] == [10.0, 15.0, 18.4] and f["lr_schedule"] == "multistep"
      assert (f["algorithm"], f["num_stages"]) == (cell["algorithm"], cell["num_stages"])
      assert t["cores"] == cell["cores"]
  order = [t["what"] for t in rec.run_order(p, "fashion_resnet")]
  assert order[:4] == ["test BP seed 0", "test BP seed 1", "test FDG K=2 seed 0",
                       "test FDG K=2 seed 1"]
  assert len(order) == len(set(order)) == sum(len(c["seeds"]) for c in
                                              p["parts"]["fashion_resnet"]["cells"].values())


def _fake(task, final: float, seconds_per_step: float, diverged=False) -> dict:
  """A record whose test accuracy climbs linearly from 0.5 at step 0 to `final` at the end."""
  f = task["fields"]
  steps = f["num_epochs"] * 468
  curve = [{"epoch": e, "step": e * 468, "wall_time": e * 468 * seconds_per_step,
            "test_accuracy": 0.5 + (final - 0.5) * e / f["num_epochs"]}
           for e in range(1, f["num_epochs"] + 1)]
  return {"key": task["key"], "seed": f["seed"], "diverged": diverged, "test_accuracy": final,
          "wall_time": steps * seconds_per_step, "curve": curve,
          "protocol_sha256": task["protocol_sha256"]}


def test_report_numbers_against_closed_form_curves():
  p = _with_horizon(20)
  tasks = rec.cell_tasks(p, "fashion_resnet")
  records = {}
  for t, final in zip(tasks["BP"], (0.90, 0.92, 0.91)):
    records[t["key"]] = _fake(t, final, 0.30)
  for t in tasks["FDG K=2"]:  # reaches 0.93 at the end: crosses BP's 0.91 earlier
    records[t["key"]] = _fake(t, 0.93, 0.18)
  for t in tasks["DDG K=4"]:
    records[t["key"]] = _fake(t, 0.89, 0.30)
  t0, t1 = tasks["FDG K=4"]
  records[t0["key"]] = _fake(t0, 0.90, 0.3)  # one seed of two: not complete
  s = rec.summarise(p, "fashion_resnet", records)
  rows, steps = s["rows"], 20 * 468
  assert rows["BP"]["final"] == pytest.approx(91.0) and rows["BP"]["each"] == pytest.approx(
      [90.0, 92.0, 91.0])
  assert rows["FDG K=2"]["gap"] == pytest.approx(2.0)
  # 0.5 + 0.43 x = 0.91 -> x = 0.41 / 0.43 of the run; in seconds at 0.18 s a step, BP's
  # own mean curve reaches its final at its end: 20 x 468 x 0.30 s.
  assert rows["FDG K=2"]["step_overhead"] == pytest.approx(0.41 / 0.43)
  assert rows["FDG K=2"]["seconds_ratio"] == pytest.approx(0.41 / 0.43 * 0.18 / 0.30)
  assert rows["DDG K=4"]["step_overhead"] is None and "seconds_to_bp" not in rows["DDG K=4"]
  assert not rows["FDG K=4"]["complete"] and rows["FDG K=4 beta 0.5"]["seeds"] == []
  targets = {t["target"]: t for t in s["targets"]}
  assert [t["met"] for t in s["targets"]] == [True, None, False, True]
  assert targets["DDG K=4 final test accuracy within 0.5 points of BP"]["value"] == \
      pytest.approx(-2.0)
  table = rec.markdown(s)
  assert "| FDG K=4 beta 0.5 | 0 of 2 | not run |" in table
  assert "**missed**" in table and "not measured yet" in table


def test_records_of_another_version_are_not_read():
  p = _with_horizon(20)
  tasks = rec.cell_tasks(p, "fashion_resnet")
  records = {t["key"]: {**_fake(t, 0.9, 0.3), "protocol_sha256": "other"}
             for t in tasks["BP"]}
  assert rec.summarise(p, "fashion_resnet", records)["rows"]["BP"]["seeds"] == []


def _tiny_protocol(tmp_path, dataset="digits", data_dir=""):
  p = copy.deepcopy(PROTOCOL)
  spec = p["parts"]["fashion_resnet"]
  spec["fields"].update(dataset=dataset, model="mlp", model_kwargs={"widths": [16, 16]},
                        eval_batch_size=512, num_epochs=2, data_dir=data_dir)
  spec["status"] = "run"
  spec["pilot"]["epochs"] = 2
  spec["cells"] = {"BP": {**spec["cells"]["BP"], "seeds": [0]},
                   "FDG K=2": {**spec["cells"]["FDG K=2"], "seeds": [0], "split": "1"}}
  spec["targets"] = []
  p["parts"] = {"tiny": spec}
  path = tmp_path / "protocol.json"
  path.write_text(json.dumps(p))
  return path


def _study(tmp_path, protocol, *flags):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  return subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "time_to_quality.py"), "--part", "tiny",
       "--protocol", str(protocol), "--out", str(tmp_path / "tiny.json"), "--workdir",
       str(tmp_path / "runs"), *flags], capture_output=True, text=True, timeout=600, env=env)


def test_a_study_runs_pinned_processes_and_records_where_they_ran(tmp_path):
  p = _study(tmp_path, _tiny_protocol(tmp_path))
  assert p.returncode == 0, p.stdout + p.stderr
  records = json.loads((tmp_path / "tiny.json").read_text())["records"]
  by_what = {r["what"]: r for r in records.values()}
  assert set(by_what) == {"pilot BP seed 0", "test BP seed 0", "test FDG K=2 seed 0"}
  bp, fdg = by_what["test BP seed 0"], by_what["test FDG K=2 seed 0"]
  assert len(bp["affinity"]) == 1 and bp["env"]["cores"] == 1  # one core, seen by XLA
  assert fdg["processes"] == 2 and fdg["cores"] == 2 and fdg["env"]["cores"] == 1
  assert fdg["num_stages"] == 2 and fdg["curve"][-1]["step"] == 2 * 11
  assert all(len(r["code_commit"]) >= 40 for r in records.values())
  report = _study(tmp_path, _tiny_protocol(tmp_path), "--report", "--targets_json")
  assert report.returncode == 0 and json.loads(report.stdout) == []


def test_a_failed_run_stops_the_study_and_records_nothing(tmp_path):
  missing = tmp_path / "no_such_dir"
  p = _study(tmp_path, _tiny_protocol(tmp_path, "mnist", str(missing)))
  assert p.returncode != 0
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("error: pilot BP seed 0 failed") and "no record was kept" in last
  out = tmp_path / "tiny.json"
  assert not out.exists() or json.loads(out.read_text())["records"] == {}


def test_the_results_page_quotes_the_report_of_the_committed_records():
  import subprocess
  import sys
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_to_quality.py"),
                        "--part", "fashion_resnet", "--report"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  block = out.stdout.strip()
  assert block.startswith(rec.MARKER)
  assert block in (ROOT / "docs" / "results.md").read_text(), \
      "docs/results.md's fashion_resnet table differs from the report"


def test_a_study_stopped_with_runs_queued_ends_and_goes_on_next_time(tmp_path):
  """SIGTERM while a two-process run starts and another waits: the study stops its run
  (once; the launcher then stops its processes, none left behind) and ends; the same
  command then finishes the part."""
  import signal
  import time
  path = _tiny_protocol(tmp_path)
  p = json.loads(path.read_text())
  p["parts"]["tiny"]["cells"]["FDG K=2"]["seeds"] = [0, 1]
  path.write_text(json.dumps(p))
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  cmd = [sys.executable, str(ROOT / "benchmarks" / "time_to_quality.py"), "--part", "tiny",
         "--protocol", str(path), "--out", str(tmp_path / "tiny.json"), "--workdir",
         str(tmp_path / "runs")]
  study = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env)
  for line in study.stdout:
    if "start test FDG K=2 seed 0" in line:
      break
  time.sleep(1.0)  # the run's processes are setting up
  study.send_signal(signal.SIGTERM)
  time.sleep(0.5)
  study.send_signal(signal.SIGTERM)  # an impatient second one changes nothing
  study.communicate(timeout=240)
  assert study.returncode == 130
  left = subprocess.run(["pgrep", "-f", str(tmp_path / "runs")], capture_output=True,
                        text=True).stdout.split()
  assert not left, left  # no worker outlived the study
  records = json.loads((tmp_path / "tiny.json").read_text())["records"]
  assert "test FDG K=2 seed 1" not in {r["what"] for r in records.values()}
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
  assert done.returncode == 0, done.stdout + done.stderr
  records = json.loads((tmp_path / "tiny.json").read_text())["records"]
  assert {r["what"] for r in records.values()} >= {"test FDG K=2 seed 0", "test FDG K=2 seed 1"}


def test_a_run_needing_more_cores_than_the_study_may_use_is_refused_not_waited_for(tmp_path):
  """Under `taskset -c 0` a two-core run would wait for a second core forever: refused at
  once, in one line, before any run starts."""
  runner = rec.CoreRunner(tmp_path / "out.json", tmp_path / "runs", cores=[0])
  tasks = [{"key": "a", "what": "test BP seed 0", "cores": 1},
           {"key": "b", "what": "test FDG K=2 seed 0", "cores": 2}]
  with pytest.raises(rec.RunFailed, match=r"test FDG K=2 seed 0 needs 2 cores and this "
                                          r"process may use 1 \(\[0\]\)"):
    runner(tasks)
  assert not (tmp_path / "runs").exists()
