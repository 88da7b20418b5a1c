"""The training loop: `train_and_evaluate(config, workdir)`.

One tick of the chosen schedule per batch, in `schedule.run` calls cut at every log,
evaluation and checkpoint step; evaluation every `eval_every_epochs` (and
`eval_every_steps`); a checkpoint every `checkpoint_every_steps`, at the end and on
SIGINT/SIGTERM; a stall watchdog around it all. Re-running with the same workdir resumes
from the latest checkpoint, exactly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from fdg_jax.config_check import UserError
from fdg_jax.runtime import arrays as runtime_arrays
from fdg_jax.runtime.watchdog import StallWatchdog
from fdg_jax.trainer.checkpoints import CHECKPOINT_DIR, Checkpointer
from fdg_jax.trainer.evaluation import evaluate, nonfinite_part, nonfinite_stage
from fdg_jax.trainer.metrics import MetricWriter, log, progress_bar, run_label
from fdg_jax.trainer.prepare import Run, setup
from fdg_jax.trainer.workdir import WRITE_ERRNOS, WorkdirLock, os_error_line

STALL_STACKS = "stall_stacks.txt"  # where a stalled run writes the stacks of its threads


class DivergedError(UserError):
  """The loss became NaN or infinite."""


class Interrupted(UserError):
  """SIGINT/SIGTERM/SIGHUP: a checkpoint was saved and the run can be resumed."""

  def __init__(self, msg: str, signum: int):
    super().__init__(msg)
    self.signum = signum


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and evaluates.

  Returns:
    a dict with the last evaluation's metrics, `steps`, `wall_time` and `params` (host copies
    of the K per-stage parameter pytrees).

  Raises:
    ConfigError, DatasetNotFoundError, DivergedError, Interrupted (all one-line messages).
  """
  with WorkdirLock(workdir, enabled=jax.process_index() == 0):
    try:
      return _train_and_evaluate(config, workdir)
    except OSError as e:  # a write that failed: the disk, a limit, permissions
      if e.errno not in WRITE_ERRNOS:
        raise
      raise UserError(os_error_line(e, workdir, "training")) from None


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  run = setup(config, workdir)
  holder: dict = {}
  watchdog = StallWatchdog(config.get("stall_timeout_s", 600),
                           config.get("stall_first_tick_s", 1800),
                           os.path.join(workdir, STALL_STACKS),
                           lambda: _describe_checkpoint(holder.get("loop"), workdir))
  watchdog.start(None)
  try:
    loop = holder["loop"] = TrainingLoop(run)
    watchdog.resumed(loop.last_good)  # the first tick still compiles: its allowance holds
    try:
      with _stop_on_signals() as stop:
        evaluated = False
        while loop.step < run.total_steps:
          loop.train_until_next_boundary()
          watchdog.dispatched(loop.step, loop.pending[-1]["loss"])
          if loop.at(config.log_every_steps):
            loop.log_progress()
          if loop.telemetry_every and loop.at(loop.telemetry_every):
            loop.measure_staleness()
          if loop.evaluation_due():
            if not evaluated:  # the first evaluation compiles its program
              watchdog.allow_compile()
            loop.evaluate_and_record()
            evaluated = True
            watchdog.beat()
          loop.end_epoch_if_done()
          if loop.at(config.checkpoint_every_steps) or loop.step == run.total_steps:
            loop.save()
            watchdog.beat()
          loop.stop_if_signalled(stop)
        loop.flush_losses()
    finally:
      loop.close()
    if not loop.final:
      watchdog.allow_compile()
    return loop.result()
  finally:
    watchdog.close()


def _describe_checkpoint(loop, workdir: str) -> str:
  """The newest-checkpoint part of a stall's line."""
  if loop is not None and loop.last_good is not None:
    return f"newest checkpoint: step {loop.last_good} in {loop.ckpt.directory}"
  directory = os.path.join(workdir, CHECKPOINT_DIR)
  return f"no checkpoint in {directory} yet"


# What a failed save's error says (orbax and tensorstore wrap the OS's), and what to do.
SAVE_FAILURES = {"RESOURCE_EXHAUSTED": "free space", "No space left": "free space",
                 "File too large": "raise the file-size limit (ulimit -f)",
                 "Read-only file system": "make the workdir writable",
                 "Permission denied": "make the workdir writable", "Disk quota": "free space"}


class TrainingLoop:
  """The state of a run between ticks, and the steps the loop takes on it.

  Ticks run in `schedule.run` calls of up to `ticks_per_call` ticks, cut at every log,
  evaluation and checkpoint step, so that the loop acts exactly where an uninterrupted
  one-tick-at-a-time loop would. Losses stay on the device until a log step.
  """

  def __init__(self, run: Run):
    self.run = run
    self.config = config = run.config
    self.schedule = run.schedule
    self.ckpt = Checkpointer(os.path.join(run.workdir, CHECKPOINT_DIR))
    self.progress = {"wall_time": 0.0, "train_loss_sum": 0.0, "train_acc_sum": 0.0,
                     "train_count": 0}
    self.state, start = self._restore_or_init()
    run.commit_config()  # config.json and config_changes.jsonl: only now that it restored
    self.last_good = start
    self.step = 0 if start is None else int(start)
    self.writer = MetricWriter(run.workdir, self.step)
    self.pending: list = []  # metrics of `run` calls whose losses are not read yet
    self.ticks_per_call = config.get("ticks_per_call", 1)
    self.telemetry_every = config.get("telemetry_every_steps", 0)
    self.telemetry: dict = {}  # the staleness measured at this step, for its metrics row
    self.run_start = time.time() - self.progress["wall_time"]
    self.final: dict = {}
    self.bar = None
    self.compiled = False  # whether the first tick (which compiles) has been dispatched
    self.since_log = {"loss": 0.0, "count": 0, "time": time.time(), "step": self.step}
    self._start_epoch_clock()

  # ---- start -----------------------------------------------------------------------------
  def _restore_or_init(self):
    """The schedule state to start from: the newest checkpoint that restores, else fresh."""
    run = self.run
    state = run.schedule.init(run.params, run.model_states,
                              rng=jax.random.PRNGKey(self.config.seed + 1),
                              example_batch=run.example)
    run.params = run.model_states = None
    if self.ckpt.latest_step() is None:
      return state, None
    # Restore into shapes and shardings only, freeing the freshly built state first, so
    # that a resume does not hold two copies of the parameters and stashes.
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        if isinstance(a, jax.Array) else a, state)
    del state
    start, state, data_state, self.progress = self.ckpt.restore_latest(target)
    state["tick"] = np.asarray(state["tick"], np.int64)
    run.train_iter.set_state(data_state)
    log(f"resumed from step {start} in {run.workdir}")
    return state, start

  def _start_epoch_clock(self):
    self.epoch_start_time = time.time()
    self.epoch_steps = 0
    self.paused = 0.0  # seconds of checkpointing within the current epoch (not training)

  # ---- training ----------------------------------------------------------------------------
  def at(self, every: int) -> bool:
    """Whether the current step is a multiple of `every`."""
    return self.step % every == 0

  def ticks_to_next_boundary(self) -> int:
    """Ticks for the next `run` call: up to ticks_per_call, ending at the next log,
    evaluation or checkpoint step (where the loop acts between calls)."""
    c, step = self.config, self.step
    every = [c.log_every_steps, c.checkpoint_every_steps, self.run.steps_per_epoch]
    if c.get("eval_every_steps", 0) > 0:
      every.append(c.eval_every_steps)
    if self.telemetry_every:
      every.append(self.telemetry_every)
    return min([self.ticks_per_call, self.run.total_steps - step]
               + [n - step % n for n in every])

  def next_batches(self, num_ticks: int):
    """`num_ticks` training batches in buffers of length ticks_per_call (one compiled
    program whatever num_ticks); fresh buffers every call, as a device may still read
    (or, on CPU, alias) the last ones. A process that holds none of stage 0's devices
    passes zeros of the batch's shape and reads no data (process 0 always feeds, and
    its data position is the one checkpointed)."""
    x, y = self.run.example
    xs = np.zeros((self.ticks_per_call,) + x.shape, x.dtype)
    ys = np.zeros((self.ticks_per_call,) + y.shape, y.dtype)
    if self.schedule.placement.feeder() is None:
      return xs, ys
    for i in range(num_ticks):
      row = next(self.run.train_iter)
      xs[i], ys[i] = row[self.run.batch_keys[0]], row[self.run.batch_keys[1]]
    return xs, ys

  def train_until_next_boundary(self) -> None:
    """One `schedule.run` call up to the next boundary; its losses stay on the device."""
    if not self.compiled:
      self.compiled = True
      if jax.process_index() == 0:
        cached = jax.config.jax_compilation_cache_dir
        log(f"compiling the first tick's programs ({run_label(self.config)}, "
            f"{self.config.num_stages} stage(s)): "
            + (f"cached in {cached} for the next run" if cached else "not cached"))
    if self.bar is None and self.config.progress_bar:
      self.bar = progress_bar(self.config, self.run.steps_per_epoch, self.step)
    num_ticks = self.ticks_to_next_boundary()
    self.state, metrics = self.schedule.run(self.state, self.next_batches(num_ticks),
                                            num_ticks)
    self.pending.append(metrics)
    self.step += num_ticks
    self.epoch_steps += num_ticks
    if self.bar is not None:
      self.bar.update(num_ticks)

  def flush_losses(self) -> None:
    """Moves the losses of the last calls to the host and stops on a non-finite one."""
    if not self.pending:
      return
    pending, self.pending = self.pending, []
    got = runtime_arrays.fetch([(m["loss"], m["accuracy"], m["valid"]) for m in pending])
    ticks = np.concatenate([np.asarray(m["tick"]) for m in pending])
    valid = np.concatenate([np.asarray(v, bool).reshape(-1) for _, _, v in got])
    losses = np.concatenate([np.asarray(l, np.float64).reshape(-1) for l, _, _ in got])[valid]
    accs = np.concatenate([np.asarray(a, np.float64).reshape(-1) for _, a, _ in got])[valid]
    if not np.all(np.isfinite(losses)):
      bad = int(ticks[valid][~np.isfinite(losses)][0]) + 1
      k = nonfinite_stage(self.schedule, self.state)
      where = f"stage {k}'s parameters" if k is not None else "the loss"
      self._diverged(f"non-finite loss at step {bad} ({where} non-finite by step "
                     f"{self.step})")
    self.since_log["loss"] += float(losses.sum())
    self.since_log["count"] += int(losses.size)
    self.progress["train_loss_sum"] += float(losses.sum())
    self.progress["train_acc_sum"] += float(accs.sum())
    self.progress["train_count"] += int(losses.size)

  def _diverged(self, what: str):
    saved = (f"last good checkpoint: step {self.last_good} in {self.ckpt.directory}"
             if self.last_good is not None else "no checkpoint was saved yet")
    raise DivergedError(f"training diverged: {what}; {saved}; lower --config.learning_rate "
                        "or --config.momentum, or try --config.beta<1")

  # ---- reporting ---------------------------------------------------------------------------
  def log_progress(self) -> None:
    """At a log step: reads the pending losses, writes a training row to metrics.jsonl
    ("kind": "train": the mean loss since the last one) and updates the progress bar, or,
    where no bar shows (no terminal: nohup, a batch job, CI), prints a line."""
    self.flush_losses()
    now, since = time.time(), self.since_log
    if since["count"]:
      rate = self.config.batch_size * (self.step - since["step"]) / max(now - since["time"], 1e-9)
      row = {"kind": "train", "step": self.step, "epoch": self.step / self.run.steps_per_epoch,
             "train_loss": since["loss"] / since["count"], "samples_per_second": rate,
             "wall_time": now - self.run_start}
      self.writer.write(row)
      if (self.bar is None or self.bar.disable) and jax.process_index() == 0:
        eta = (self.run.total_steps - self.step) * (now - since["time"]) / max(
            self.step - since["step"], 1)
        print(f"step {self.step}/{self.run.total_steps} (epoch "
              f"{-(-self.step // self.run.steps_per_epoch)}/{self.config.num_epochs}): loss "
              f"{row['train_loss']:.4f}, {rate:,.0f} examples/s, ETA {_duration(eta)}",
              file=sys.stderr, flush=True)
    self.since_log = {"loss": 0.0, "count": 0, "time": now, "step": self.step}
    p = self.progress
    if self.bar is not None and p["train_count"]:
      self.bar.set_postfix(loss=p["train_loss_sum"] / p["train_count"],
                           samples_s=self._samples_per_second(time.time()))

  def measure_staleness(self) -> None:
    """Per-stage weight discrepancy and gradient cosine (`Schedule.telemetry`) at this
    step: into this step's evaluation row, or a row of their own."""
    self.telemetry = {"step": self.step, **self.schedule.telemetry(self.state)}
    if not self.evaluation_due():
      spe = self.run.steps_per_epoch
      self.writer.write({"epoch": self.step / spe, **self.telemetry})

  def _samples_per_second(self, now: float) -> float:
    seconds = now - self.epoch_start_time - self.paused
    return self.config.batch_size * self.epoch_steps / max(seconds, 1e-9)

  def _end_of_epoch(self) -> bool:
    return self.step % self.run.steps_per_epoch == 0

  def evaluation_due(self) -> bool:
    """Whether the current step evaluates (epoch end, eval_every_steps, the last step)."""
    epoch = self.step // self.run.steps_per_epoch
    every = self.config.get("eval_every_steps", 0)
    return ((self._end_of_epoch() and epoch % self.config.eval_every_epochs == 0)
            or (every > 0 and self.step % every == 0)
            or self.step == self.run.total_steps)

  def evaluate_and_record(self) -> None:
    """Test-set metrics plus the training averages since the last epoch end, to
    metrics.jsonl (and TensorBoard)."""
    self.flush_losses()
    now, p, spe = time.time(), self.progress, self.run.steps_per_epoch
    record = {
        "epoch": self.step // spe if self._end_of_epoch() else self.step / spe,
        "step": self.step,
        "train_loss": _mean(p["train_loss_sum"], p["train_count"]),
        "train_accuracy": _mean(p["train_acc_sum"], p["train_count"]),
        **evaluate(self.schedule, self.state, self.run.test_iter(), self.run.batch_keys),
        "learning_rate": float(self.run.learning_rate(self.step)),
        "samples_per_second": self._samples_per_second(now),
        "wall_time": time.time() - self.run_start,
    }
    if self.telemetry.get("step") == self.step:
      record.update(self.telemetry)
    self.writer.write(record)
    self.final = record
    if self.bar is not None:
      self.bar.set_postfix(loss=record["train_loss"], test_acc=record["test_accuracy"],
                           samples_s=record["samples_per_second"])

  def end_epoch_if_done(self) -> None:
    """At an epoch's end: reset the training averages (where an evaluation happened; one
    where a run stops mid-epoch leaves the sums be) and the epoch's clock and bar."""
    if not self._end_of_epoch():
      return
    if self.evaluation_due():
      self.progress.update(train_loss_sum=0.0, train_acc_sum=0.0, train_count=0)
      self._start_epoch_clock()
    if self.bar is not None:
      self.bar.close()
      self.bar = None

  # ---- checkpoints and stopping --------------------------------------------------------------
  def save(self) -> None:
    """Checkpoints the state at `step`, unless any part of it is non-finite."""
    t0 = time.time()
    self.flush_losses()
    # A parameter can go non-finite ticks before its effect reaches the loss (stage 0's
    # update shows in a loss K ticks later under FDG): never checkpoint such a state.
    bad = nonfinite_part(self.schedule, self.state)
    if bad is not None:
      self._diverged(f"{bad} non-finite at step {self.step}")
    self.progress["wall_time"] = time.time() - self.run_start
    try:
      self.ckpt.save(self.step, self.state, self.run.train_iter.get_state(), self.progress)
    except Exception as e:  # noqa: BLE001  orbax and tensorstore wrap the OS's error
      text = " ".join(str(e).split())
      why = next((w for w in SAVE_FAILURES if w in text), None)
      if why is None and not (isinstance(e, OSError) and e.errno in WRITE_ERRNOS):
        raise
      kept = (f"the checkpoint of step {self.last_good} is kept" if self.last_good is not None
              else "no checkpoint was saved yet")
      why, fix = (why, SAVE_FAILURES[why]) if why else (text[:120], "free space")
      raise UserError(f"could not save the checkpoint of step {self.step} in "
                      f"{self.ckpt.directory} ({why}); {kept}: {fix} and run the same "
                      "command to resume") from None
    self.last_good = self.step
    self.paused += time.time() - t0

  def stop_if_signalled(self, stop: dict) -> None:
    """After SIGINT/SIGTERM: checkpoint and raise Interrupted.

    Several processes must stop (and join the collective save) at the same step: a signal
    one of them got is acted on at the next log step, agreed by all.
    """
    multi_process = jax.process_count() > 1
    agreed = not multi_process or self.at(self.config.log_every_steps)
    if multi_process and agreed:
      from jax.experimental import multihost_utils
      signums = multihost_utils.process_allgather(np.int32(stop["signum"] or 0))
      stop["signum"] = int(np.max(signums)) or None
    if stop["signum"] is None or not agreed:
      return
    if self.last_good != self.step:
      self.save()
    name = signal.Signals(stop["signum"]).name
    raise Interrupted(f"{name}: stopped at step {self.step}, checkpoint saved in "
                      f"{self.ckpt.directory}; run the same command to resume", stop["signum"])

  # ---- end ---------------------------------------------------------------------------------
  def close(self) -> None:
    """Closes the bar, the data iterator, the metrics writer and the checkpointer."""
    if self.bar is not None:
      self.bar.close()
    self.run.train_iter.close()
    self.writer.close()
    self.ckpt.close()

  def result(self) -> dict:
    """The last evaluation (made now if the loop made none), steps, wall time, params."""
    if not self.final:
      self.final = {"step": self.step, **evaluate(self.schedule, self.state,
                                                  self.run.test_iter(), self.run.batch_keys)}
    wall = time.time() - self.run_start
    if jax.process_index() == 0:
      log(f"done: {run_label(self.config)}, {self.step} steps, final test accuracy "
           f"{self.final['test_accuracy']:.4f} (loss {self.final['test_loss']:.4f}) in "
           f"{wall:.1f} s; workdir {self.run.workdir}")
    return {**self.final, "steps": self.step, "wall_time": wall,
            "params": runtime_arrays.fetch(self.schedule.params(self.state))}


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _mean(total, count):
  return total / count if count else None  # null in metrics.jsonl: no batch reached the loss


@contextlib.contextmanager
def _stop_on_signals():
  """Turns SIGINT/SIGTERM/SIGHUP (a closed terminal) into a flag checked between ticks
  (main thread only)."""
  flag: dict[str, Any] = {"signum": None}
  previous: dict = {}

  def handler(signum, frame):
    del frame
    flag["signum"] = signum
    signal.signal(signum, previous.get(signum, signal.SIG_DFL))  # a second signal is not caught

  try:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN:
        continue  # under nohup a closed terminal must not stop the run
      previous[s] = signal.signal(s, handler)
  except ValueError:  # not the main thread: no signal handling
    previous = {}
  try:
    yield flag
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
