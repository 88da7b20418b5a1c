"""Faults as a careless user and an unlucky machine make them: real processes, real signals,
real files. One run per workdir; a resume that fails changes nothing; a checkpoint whose
bytes changed is found and skipped; a metrics line cut mid-write; bad values refused."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from fdg_jax import trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_trainer import _params_equal, _train_cli, read_metrics, tiny_config  # noqa: E402


def _wait_for_lock(workdir, proc, timeout=120):
  lock = workdir / "run.lock"
  end = time.time() + timeout
  while time.time() < end:
    if lock.exists() and '"started"' in lock.read_text():
      return
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.1)
  raise AssertionError("the first run never took the lock")


def test_a_second_run_on_a_workdir_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
  workdir = tmp_path / "run"
  first = _train_cli(workdir, "--config.num_epochs=200")
  try:
    _wait_for_lock(workdir, first)
    second = _train_cli(workdir, "--config.num_epochs=200")
    out, err = second.communicate(timeout=300)
    assert second.returncode == 1
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in err
    assert f"in use by process {first.pid}" in lines[0] and "another --workdir" in lines[0]
    assert first.poll() is None  # the first run goes on untouched
  finally:
    first.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel releases it
    first.wait()
  third = _train_cli(workdir, "--config.num_epochs=1")
  out, err = third.communicate(timeout=300)
  assert third.returncode == 0, err
  assert f"took over the lock of {workdir} from process {first.pid}" in out


def test_a_failed_resume_leaves_every_file_as_it_was(tmp_path):
  """config.json missing, resumed with other widths: the restore fails, and neither
  config.json nor config_changes.jsonl nor metrics.jsonl was written (the original
  command then resumes)."""
  c = tiny_config(num_epochs=2, max_steps=30)
  trainer.train_and_evaluate(c, str(tmp_path))
  (tmp_path / "config.json").unlink()
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
            and "tensorboard" not in str(p)}
  other = tiny_config(num_epochs=2)
  other.model_kwargs.widths = (48, 48, 48)
  with pytest.raises(trainer.CheckpointError):
    trainer.train_and_evaluate(other, str(tmp_path))
  after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
           and "tensorboard" not in str(p) and p.name != "run.lock"}
  assert {p: b for p, b in before.items() if p.name != "run.lock"} == after
  c.max_steps = -1
  resumed = trainer.train_and_evaluate(c, str(tmp_path))
  full = trainer.train_and_evaluate(tiny_config(num_epochs=2), str(tmp_path / "full"))
  assert _params_equal(resumed["params"], full["params"])


def _flip_one_bit(step_dir: pathlib.Path) -> pathlib.Path:
  """Flips one bit in the middle of the step's largest array data file."""
  data = max((p for p in step_dir.rglob("*") if p.is_file() and "_METADATA" not in p.name
              and p.suffix != ".json"), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x10
  data.write_bytes(bytes(raw))
  return data


def test_a_flipped_bit_is_found_and_the_step_before_restores_bitwise(tmp_path, capfd):
  c = tiny_config(algorithm="fdg", num_stages=3, num_epochs=2)
  c.model_kwargs.widths = (16, 16, 16)
  full = trainer.train_and_evaluate(c, str(tmp_path / "full"))
  c.max_steps = 30  # checkpoints at steps 28 and 30 are kept
  trainer.train_and_evaluate(c, str(tmp_path / "run"))
  sums = json.loads((tmp_path / "run" / "checkpoint_checksums.json").read_text())
  assert sorted(sums) == ["28", "30"] and all(sums.values())
  flipped = _flip_one_bit(tmp_path / "run" / "checkpoints" / "30")
  c.max_steps = -1
  capfd.readouterr()
  resumed = trainer.train_and_evaluate(c, str(tmp_path / "run"))
  out = capfd.readouterr().out
  skipped = [l for l in out.splitlines() if "does not restore" in l]
  assert len(skipped) == 1 and "checkpoint step 30" in skipped[0]
  assert "differs from its checksum" in skipped[0] and flipped.name in skipped[0]
  assert "resumed from step 28" in out
  assert _params_equal(resumed["params"], full["params"])


def test_a_metrics_line_cut_mid_write_is_dropped_on_resume(tmp_path, capfd):
  c = tiny_config(num_epochs=3, max_steps=50)
  trainer.train_and_evaluate(c, str(tmp_path))
  path = tmp_path / trainer.METRICS_FILE
  path.write_text(path.read_text() + '{"epoch": 3, "step": 6')  # what a full disk leaves
  c.max_steps = -1
  capfd.readouterr()
  trainer.train_and_evaluate(c, str(tmp_path))
  assert "dropped the last line of" in capfd.readouterr().out
  rows = read_metrics(tmp_path)  # the stop at step 50 evaluated too
  assert [r["step"] for r in rows] == [22, 44, 50, 66]


@pytest.mark.parametrize("flag,words", [
    ("--config.weight_decay=nan", "weight_decay=nan must be a finite number"),
    ("--config.warmup_epochs=nan", "warmup_epochs=nan must be a finite number"),
    ("--config.learning_rate=inf", "learning_rate=inf must be a finite number"),
    ("--config.seed=-1", "seed=-1 must be an integer in [0, 2**63)"),
    ("--config.seed=18446744073709551617", "must be an integer in [0, 2**63)"),
    ("--config.model_kwargs.widths=(32,0,32)", "model_kwargs.widths"),
    ("--config.model_kwargs.widths=(32,-4)", "model_kwargs.widths"),
    ("--config.dc_lambda=-0.5", "dc_lambda=-0.5 must be >= 0"),
    ("--config.nesterov_gamma=1.5", "nesterov_gamma=1.5 must lie in [0, 1)"),
    ("--config.split_cost=gpu", "split_cost='gpu' is not one of flops, bytes, time"),
    ("--config.dataset=stdlib_text", "use --config configs/lm.py"),
])
def test_bad_values_are_refused_in_one_line_before_training(tmp_path, flag, words):
  p = _train_cli(tmp_path / "run", flag)
  out, err = p.communicate(timeout=300)
  lines = [l for l in err.splitlines() if l.strip()]
  assert p.returncode == 2, err
  assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, lines
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("x")
  p = _train_cli(afile)
  out, err = p.communicate(timeout=300)
  lines = [l for l in err.splitlines() if l.strip()]
  assert p.returncode == 1 and len(lines) == 1 and "is a file, not a folder" in lines[0]
  p = _train_cli(tmp_path / ("x" * 300))
  out, err = p.communicate(timeout=300)
  lines = [l for l in err.splitlines() if l.strip()]
  assert p.returncode == 1 and len(lines) == 1 and "a name is too long" in lines[0], err
  if os.geteuid() != 0:  # root writes anywhere: the read-only case needs another user
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    p = _train_cli(ro / "run")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "permission denied" in err


def test_eval_batch_size_above_the_test_split_is_clamped(tmp_path):
  c = tiny_config(num_epochs=1, eval_batch_size=10 ** 8)
  result = trainer.train_and_evaluate(c, str(tmp_path))
  assert np.isfinite(result["test_loss"])


def test_fewer_devices_than_stages_is_said_or_refused(capsys):
  assert len(jax.devices()) == 4  # conftest
  with pytest.raises(trainer.ConfigError, match="engine=per_stage puts stage k on device k: "
                     "8 stages, found 4 devices"):
    trainer.choose_placement(8, 1, "per_stage")
  where = trainer.choose_placement(8, 1, "auto")
  assert where["devices"] is None  # every stage in one program
  assert "4 devices for 8 stages: every stage runs on" in capsys.readouterr().out
  trainer.choose_placement(4, 1, "auto")  # a device per stage possible: nothing to say
  assert "devices for" not in capsys.readouterr().out


def test_turning_momentum_off_on_a_resume_is_refused_and_writes_nothing(tmp_path):
  c = tiny_config(optimizer="sgd", momentum=0.9, max_steps=10)
  trainer.train_and_evaluate(c, str(tmp_path))
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
            and "tensorboard" not in str(p) and p.name != "run.lock"}
  with pytest.raises(trainer.ConfigError, match=r"momentum=0\.0 turns that part of the sgd "
                     r"optimiser off.*resume with any momentum > 0"):
    trainer.train_and_evaluate(tiny_config(optimizer="sgd", momentum=0.0), str(tmp_path))
  after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
           and "tensorboard" not in str(p) and p.name != "run.lock"}
  assert before == after and not (tmp_path / trainer.CONFIG_CHANGES_FILE).exists()
  # Another non-zero momentum is a change the resume takes (and records).
  trainer.train_and_evaluate(tiny_config(optimizer="sgd", momentum=0.5, max_steps=20),
                             str(tmp_path))
  assert (tmp_path / trainer.CONFIG_CHANGES_FILE).exists()


def test_labels_outside_the_classes_are_refused_where_the_data_enters(monkeypatch, tmp_path):
  from fdg_jax import data
  real = data.load

  def shifted(name, split="train", data_dir=None, **kw):
    ds = real(name, split, data_dir, **kw)
    if split == "test":
      ds.labels = ds.labels.copy()
      ds.labels[3] = -1  # what a loader that marks unlabelled examples with -1 gives
    return ds
  monkeypatch.setattr(data, "load", shifted)
  with pytest.raises(trainer.UserError, match=r"digits test: label -1 lies outside \[0, 10\)"):
    trainer.train_and_evaluate(tiny_config(max_steps=3), str(tmp_path))
  assert not (tmp_path / "checkpoints").exists()


def test_a_file_size_limit_at_a_save_is_one_line_and_the_resume_is_bitwise(tmp_path):
  """`ulimit -f` (RLIMIT_FSIZE, set in the child) below a checkpoint's size: the save fails
  in orbax's writer threads; the run stops with one line naming the step it kept, and the
  same command without the limit goes on from there to an uninterrupted run's result."""
  import resource
  flags = ["--config.num_epochs=1", "--config.checkpoint_every_steps=10",
           "--config.compilation_cache=off", "--config.model_kwargs.widths=(16,16,16)"]

  def run(workdir, *extra, limit=None):
    pre = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
    p = _train_cli(workdir, *flags, *extra, preexec_fn=pre)
    out, err = p.communicate(timeout=300)
    return p.returncode, err

  assert run(tmp_path / "full")[0] == 0
  assert run(tmp_path / "run", "--config.max_steps=20")[0] == 0
  before = json.loads((tmp_path / "run" / "checkpoint_checksums.json").read_text())["20"]
  rc, err = run(tmp_path / "run", limit=16 * 1024)
  lines = [l for l in err.splitlines() if l.strip()]
  assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
  assert lines[0].startswith("error: could not save the checkpoint of step 30 ")
  assert "(File too large); the checkpoint of step 20 is kept" in lines[0]
  assert lines[0].endswith(f"--workdir {tmp_path / 'run'}")
  trainer.checkpoints.Checkpointer(str(tmp_path / "run" / "checkpoints")).verify(20)
  sums = json.loads((tmp_path / "run" / "checkpoint_checksums.json").read_text())
  assert sums["20"] == before
  rc, err = run(tmp_path / "run")
  assert rc == 0, err
  full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "run")
  strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_time", "samples_per_second")}
  assert strip(resumed[-1]) == strip(full[-1]) and resumed[-1]["step"] == 44


def test_a_full_disk_at_the_first_save_is_one_line(tmp_path):
  """A real full disk: a 600 KiB tmpfs (mounting one needs root; skipped elsewhere)."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs",
                                          str(disk)], capture_output=True).returncode:
    pytest.skip("mounting a small tmpfs needs root")
  try:
    p = _train_cli(disk / "run", "--config.num_epochs=1", "--config.compilation_cache=off")
    out, err = p.communicate(timeout=300)
    lines = [l for l in err.splitlines() if l.strip()]
    assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "could not save the checkpoint of step" in lines[0]
    assert "no checkpoint was saved yet: free space and resume with: " in lines[0]
  finally:
    subprocess.run(["umount", str(disk)], check=True)
