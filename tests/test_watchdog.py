"""The stall watchdog: a run that stops making progress says so, keeps its checkpoint, exits 4,
and a rerun resumes exactly."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fdg_jax import trainer
from fdg_jax.runtime.watchdog import EXIT_STALLED, StallWatchdog

from test_trainer import _params_equal, tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _NeverReady:
  def is_ready(self):
    return False


class _Ready:
  def is_ready(self):
    return True


def _watch(tmp_path, timeout_s=0.4, first_s=0.4):
  exits = []
  dog = StallWatchdog(timeout_s, first_s, str(tmp_path / "stacks.txt"),
                      lambda: "newest checkpoint: step 7 in /x", exit_fn=exits.append)
  return dog, exits


def _wait_for(exits, seconds):
  end = time.monotonic() + seconds
  while not exits and time.monotonic() < end:
    time.sleep(0.05)


def test_a_tick_that_never_completes_is_reported_with_its_step_and_stacks(tmp_path, capfd):
  dog, exits = _watch(tmp_path)
  dog.start(None)
  try:
    dog.dispatched(3, _Ready())
    dog.dispatched(6, _NeverReady())
    t0 = time.monotonic()
    _wait_for(exits, 10)
    waited = time.monotonic() - t0
  finally:
    dog.close()
  assert exits == [EXIT_STALLED]
  assert 0.4 <= waited < 3.0, waited
  err = capfd.readouterr().err.strip().splitlines()
  assert len(err) == 1
  assert re.match(r"error: run stalled: nothing completed for \d+ s after step 3 \(in ", err[0])
  assert "newest checkpoint: step 7 in /x" in err[0]
  assert str(tmp_path / "stacks.txt") in err[0]
  stacks = (tmp_path / "stacks.txt").read_text()
  assert "fdg_jax-stall-watchdog" in stacks and "[main]" in stacks


def test_steady_progress_never_fires_and_close_stops_it(tmp_path):
  dog, exits = _watch(tmp_path, timeout_s=0.5, first_s=0.5)
  dog.start(None)
  try:
    for step in range(12):  # 1.2 s of ticks completing every 0.1 s: more than the timeout
      dog.dispatched(step, _Ready())
      time.sleep(0.1)
    dog.beat()
  finally:
    dog.close()
  time.sleep(0.8)
  assert exits == []


class _SlowReady:
  """An output whose readiness check takes a while (the watchdog's thread is inside it)."""

  def __init__(self):
    self.entered = threading.Event()

  def is_ready(self):
    self.entered.set()
    time.sleep(0.5)
    return True


def test_close_joins_the_thread_even_while_it_polls(tmp_path):
  # A polling thread left running at interpreter exit is ended by pthread_exit, which aborts
  # the process when it unwinds through jaxlib's frames: close() must not return before the
  # thread has ended.
  dog, exits = _watch(tmp_path, timeout_s=2.0, first_s=2.0)
  dog.start(None)
  thread = dog._thread
  slow = _SlowReady()
  dog.dispatched(1, slow)
  assert slow.entered.wait(5.0)
  dog.close()
  assert not thread.is_alive()
  assert exits == []


def test_the_first_tick_and_allowed_compiles_get_the_longer_allowance(tmp_path):
  dog, exits = _watch(tmp_path, timeout_s=0.3, first_s=1.5)
  dog.start(None)
  try:
    time.sleep(0.8)  # compiling the first tick: within 1.5 s
    assert exits == []
    dog.dispatched(1, _Ready())
    time.sleep(0.2)
    dog.allow_compile()  # the first evaluation
    time.sleep(0.8)
    assert exits == []
    dog.beat()  # evaluated: back to 0.3 s
    _wait_for(exits, 3)
    assert exits == [EXIT_STALLED]
  finally:
    dog.close()


def test_disabled_watchdog_starts_no_thread(tmp_path):
  dog, exits = _watch(tmp_path, timeout_s=0)
  dog.start(None)
  dog.dispatched(1, _NeverReady())
  time.sleep(0.3)
  dog.close()
  assert exits == [] and dog._thread is None
  assert not (tmp_path / "stacks.txt.backstop").exists()


# The trainer with a training-data source that blocks for ever at its 25th batch: the run
# checkpoints at step 20 (checkpoint_every_steps=10), completes the epoch's 22 steps and its
# evaluation, and then waits in next_batches for the batch of step 25.
CHILD = textwrap.dedent("""
    import json, sys, threading
    sys.path.insert(0, sys.argv[1])
    from fdg_jax import trainer
    from test_trainer import tiny_config

    class Blocking:
      def __init__(self, inner, after):
        self.inner, self.after, self.rows = inner, after, 0
      def __next__(self):
        self.rows += 1
        if self.rows > self.after:
          import time
          open(sys.argv[2] + ".blocked", "w").write(repr(time.time()))
          threading.Event().wait()  # a data source that hangs
        return next(self.inner)
      def __iter__(self):
        return self
      def __getattr__(self, name):
        return getattr(self.inner, name)

    from fdg_jax.trainer import prepare  # where setup reads the data from
    real = prepare._data
    def blocking_data(config, feeding):
      train_iter, *rest = real(config, feeding)
      return (Blocking(train_iter, int(sys.argv[3])), *rest)
    prepare._data = blocking_data
    c = tiny_config(**json.loads(sys.argv[4]))
    trainer.train_and_evaluate(c, sys.argv[2])
    print("finished without stalling")
""")


def test_a_blocked_data_source_stalls_the_run_with_one_line_exit_4_and_resumes(tmp_path):
  fields = dict(algorithm="fdg", num_stages=2, checkpoint_every_steps=10, log_every_steps=5,
                stall_timeout_s=5, stall_first_tick_s=300)
  full = trainer.train_and_evaluate(tiny_config(**fields), str(tmp_path / "full"))

  import json
  workdir = tmp_path / "stalled"
  out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "tests"), str(workdir), "24",
                        json.dumps(fields)], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
  exited = time.time()
  assert out.returncode == EXIT_STALLED, out.stderr[-3000:]
  assert "finished without stalling" not in out.stdout
  lines = [l for l in out.stderr.splitlines() if "stalled" in l]
  assert len(lines) == 1, out.stderr[-3000:]
  line = lines[0]
  checkpoints = workdir / trainer.CHECKPOINT_DIR
  assert re.match(r"error: run stalled: nothing completed for [5-9] s after step 22 "
                  r"\(waiting for training data\)", line), line
  assert f"newest checkpoint: step 20 in {checkpoints}" in line, line
  assert "rerun the same command to resume" in line
  stacks = (workdir / trainer.STALL_STACKS).read_text()
  assert "next_batches" in stacks and "__next__" in stacks
  # The last good checkpoint is kept and the same config resumes from it, exactly.
  assert (checkpoints / "20").is_dir() or any(p.name.endswith("20") for p in
                                              checkpoints.iterdir())
  resumed = trainer.train_and_evaluate(tiny_config(**fields), str(workdir))
  assert resumed["steps"] == full["steps"]
  assert _params_equal(resumed["params"], full["params"])
  # From the data source blocking to the process's end: the timeout plus the poll (<= 1 s).
  stall_to_exit = exited - float(pathlib.Path(str(workdir) + ".blocked").read_text())
  assert 5.0 <= stall_to_exit < 30.0, stall_to_exit
  print(f"stall to exit {stall_to_exit:.2f} s at stall_timeout_s=5")


@pytest.mark.parametrize("value", [-1, -0.5])
def test_a_bad_stall_timeout_is_one_config_error(value):
  from fdg_jax import config_check
  c = tiny_config(stall_timeout_s=value)
  with pytest.raises(config_check.ConfigError, match=r"^stall_timeout_s=.* must be a number "
                     r"of seconds >= 0 \(0: no stall watchdog\)$"):
    config_check.validate_fields(c)


def test_a_stalled_runs_line_gives_the_command_lines_resume_command(tmp_path, capfd,
                                                                   monkeypatch):
  from fdg_jax.runtime import watchdog
  monkeypatch.setitem(watchdog.RESUME_HINT, "text",
                      "resume with: python train.py --config c.py --workdir runs/x")
  dog, exits = _watch(tmp_path)
  dog.start(None)
  try:
    dog.dispatched(3, _Ready())
    dog.dispatched(6, _NeverReady())
    _wait_for(exits, 10)
  finally:
    dog.close()
  err = capfd.readouterr().err.strip().splitlines()
  assert exits == [EXIT_STALLED] and len(err) == 1
  assert "; resume with: python train.py --config c.py --workdir runs/x (or raise" in err[0]
  assert "same command" not in err[0]
