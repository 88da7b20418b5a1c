"""What a user without a terminal sees: progress lines on stderr and training rows in
metrics.jsonl every log_every_steps, a line before the first compilation, and interrupt
lines whose resume command works when pasted (the default timestamped workdir included)."""

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_trainer import read_metrics  # noqa: E402


def test_progress_lines_and_training_rows_without_a_terminal(tmp_path):
  # stderr is a pipe, as under nohup or a batch system: tqdm shows no bar.
  cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
         "--workdir", str(tmp_path), "--config.num_epochs=2", "--config.log_every_steps=20"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
  assert p.returncode == 0, p.stderr
  steps = 2 * (1437 // 32)  # 88
  lines = [l for l in p.stderr.splitlines() if l.startswith("step ")]
  assert [l.split()[1] for l in lines] == [f"{s}/{steps}" for s in range(20, steps + 1, 20)]
  assert all("loss " in l and "examples/s" in l and "ETA" in l for l in lines)
  assert "compiling the first tick's programs" in p.stdout
  train = read_metrics(tmp_path, kind="train")
  assert [r["step"] for r in train] == list(range(20, steps + 1, 20))
  assert all(r["train_loss"] > 0 and r["samples_per_second"] > 0 for r in train)
  assert [r["epoch"] for r in read_metrics(tmp_path)] == [1, 2]  # evaluations as before


def _interrupt(tmp_path, sig):
  """train.py without --workdir (a new timestamped folder under ./runs), stopped by `sig`
  once it has evaluated: (exit code, its last stderr line)."""
  cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
         "--config.num_epochs=300", "--config.progress_bar=False"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # SIGHUP as a terminal leaves it (not ignored, as under nohup, where a run keeps going).
  run = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
  end = time.time() + 120
  while time.time() < end and not list((tmp_path / "runs").glob("*/metrics.jsonl")):
    time.sleep(0.2)
  run.send_signal(sig)
  out, err = run.communicate(timeout=120)
  return run.returncode, err.strip().splitlines()[-1]


def test_the_interrupt_line_gives_a_resume_command_that_resumes(tmp_path):
  code, line = _interrupt(tmp_path, signal.SIGINT)
  assert code == 128 + signal.SIGINT and "resume with: " in line, line
  command = shlex.split(line.split("resume with: ", 1)[1])
  assert command[0] == "python" and "--workdir" in command
  workdir = command[command.index("--workdir") + 1]
  command = [sys.executable, *command[1:], "--config.max_steps=5"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=300)
  assert f"resumed from step" in p.stdout and workdir in p.stdout, p.stdout + p.stderr


def test_a_closed_terminal_saves_and_stops_like_sigterm(tmp_path):
  code, line = _interrupt(tmp_path, signal.SIGHUP)
  assert code == 128 + signal.SIGHUP and line.startswith("SIGHUP: stopped at step"), line
  assert "checkpoint saved" in line


def _quick_run(cwd):
  cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
         "--config.num_epochs=300", "--config.progress_bar=False"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def test_ctrl_c_during_set_up_is_one_line(tmp_path):
  run = _quick_run(tmp_path)
  time.sleep(1.5)  # importing JAX and building the run: no handler of the loop yet
  run.send_signal(signal.SIGINT)
  out, err = run.communicate(timeout=120)
  assert run.returncode == 128 + signal.SIGINT, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  assert err.strip().splitlines()[-1].startswith("interrupted"), err


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_the_run_resumes(tmp_path):
  run = _quick_run(tmp_path)
  end = time.time() + 120
  while time.time() < end and not [d for d in (tmp_path / "runs").glob("*/checkpoints/*")
                                   if d.name.isdigit()]:  # a finished save
    time.sleep(0.05)
  run.send_signal(signal.SIGINT)
  time.sleep(0.02)  # the first sets the loop's flag; the second lands in its save or in set-up
  run.send_signal(signal.SIGINT)
  out, err = run.communicate(timeout=120)
  assert run.returncode == 128 + signal.SIGINT, err
  assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
  line = err.strip().splitlines()[-1]
  assert "resume with: " in line, line
  command = shlex.split(line.split("resume with: ", 1)[1])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  p = subprocess.run([sys.executable, *command[1:], "--config.max_steps=100"], cwd=tmp_path,
                     env=env, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and "resumed from step" in p.stdout, p.stdout + p.stderr
