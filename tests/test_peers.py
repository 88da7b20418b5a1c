"""A lost peer process: the others end within the heartbeat timeout with one line naming it
and the newest checkpoint (exit code 3), and a rerun of every process resumes exactly.

The processes are started by hand with the JAX_* variables, as a cluster scheduler does
(not through `fdg_jax.launch`, which stops every process when one fails).
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from fdg_jax import trainer
from fdg_jax.runtime import peers

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from fdg_jax.launch import free_port as free_port_for_test  # noqa: E402
from test_trainer import read_metrics, tiny_config  # noqa: E402

FLAGS = ["--config.progress_bar=False", "--config.num_replicas=1", "--config.num_stages=2",
         "--config.num_epochs=2", "--config.batch_size=64", "--config.eval_batch_size=128",
         "--config.learning_rate=0.1", "--config.warmup_epochs=0",
         "--config.lr_schedule=constant", "--config.model_kwargs.widths=(16,16)",
         "--config.checkpoint_every_steps=10", "--config.ticks_per_call=1",
         "--config.peer_timeout_s=5"]
SAMPLE_LOST_1 = """E1201 21:33:10.431373   17947 coordination_service.cc:1549] [1102] Use error polling
to propagate the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy
(stopped sending heartbeats):
1
The tasks have crashed."""
SAMPLE_LOST_0 = """W1201 21:34:05.475169 18392 preemption_sync_manager.cc:147] Failed to retrieve
preemption notice from coordination service: UNAVAILABLE: Socket closed"""


def test_diagnosis_names_the_lost_process():
  assert peers.diagnose(SAMPLE_LOST_1) == (1, "its heartbeats stopped")
  assert peers.diagnose(SAMPLE_LOST_0)[0] == 0
  assert peers.diagnose("JaxRuntimeError: Gloo all-reduce failed: Connection closed by peer "
                        "[127.0.0.1]:49543")[0] is None
  assert peers.diagnose("ValueError: something else") == (False, None)
  assert peers.workdir_of(["train.py", "--workdir", "w"]) == "w"
  assert peers.workdir_of(["train.py", "--workdir=v"]) == "v"
  assert peers.is_multiprocess_env({"JAX_NUM_PROCESSES": "2"})
  assert not peers.is_multiprocess_env({"JAX_NUM_PROCESSES": "1"})


def test_newest_checkpoint_skips_half_written_steps(tmp_path):
  assert peers.newest_checkpoint(str(tmp_path)).startswith("none yet")
  for name in ("10", "20", "30.orbax-checkpoint-tmp-1"):
    (tmp_path / "checkpoints" / name).mkdir(parents=True)
  assert peers.newest_checkpoint(str(tmp_path)) == f"step 20 in {tmp_path / 'checkpoints'}"


def _start(workdir, port):
  procs = []
  for i in (0, 1):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/default.py"),
           "--workdir", str(workdir), *FLAGS]
    procs.append(subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  return procs


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_ends_the_other_in_one_line_and_the_rerun_resumes(tmp_path, victim):
  workdir = tmp_path / "multi"
  procs = _start(workdir, free_port_for_test())
  try:
    deadline = time.monotonic() + 240
    while not any(n.isdigit() for n in (os.listdir(workdir / "checkpoints")
                                        if (workdir / "checkpoints").is_dir() else [])):
      assert time.monotonic() < deadline, "no checkpoint written"
      assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
      time.sleep(0.2)
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = procs[1 - victim]
    _, err = survivor.communicate(timeout=120)
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert survivor.returncode == peers.EXIT_CODE, err
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  who = "process 0 (the coordinator)" if victim == 0 else "process 1"
  assert lines[0].startswith(f"error: lost {who} of 2 ("), lines[0]
  assert f"this is process {1 - victim}" in lines[0]
  assert "newest checkpoint: step " in lines[0] and str(workdir / "checkpoints") in lines[0]
  # The heartbeat timeout (5 s) bounds it, with room for the machine's load.
  assert took < 5 + 25, took
  # Every process rerun on the same workdir: resumes, and ends where one process ends.
  procs = _start(workdir, free_port_for_test())
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs
  assert "resumed from step" in outs[0][0]
  c = tiny_config(num_replicas=1, num_stages=2, num_epochs=2, batch_size=64,
                  eval_batch_size=128, checkpoint_every_steps=1000, algorithm="fdg")
  c.model_kwargs.widths = (16, 16)
  single = trainer.train_and_evaluate(c, str(tmp_path / "single"))
  multi = read_metrics(workdir)
  assert multi[-1]["step"] == single["steps"]
  assert abs(multi[-1]["test_loss"] - single["test_loss"]) < 1e-5
