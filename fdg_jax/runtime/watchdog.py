"""A stall watchdog: a run that stops making progress says so and ends, instead of waiting
for ever.

The training loop tells the watchdog what it dispatched (`dispatched(step, array)`, an output
of the ticks up to `step`) and when it finished something that is not a tick (`beat()`, after
an evaluation or a checkpoint). A thread polls the dispatched arrays: a tick has completed
when its output is ready. When nothing completes for `timeout_s` (`first_timeout_s` until
the process's first tick completes, and after `allow_compile()`, since those wait for
compilation), the watchdog

1. writes the Python stack of every thread to `stacks_path`,
2. prints one line on stderr: that the run stalled, after which step, where the loop was
   waiting (for data, for the device, in an evaluation or a checkpoint), the stacks' file,
   the newest checkpoint, how to resume,
3. ends the process with `EXIT_STALLED`, without writing anything else: the newest
   checkpoint is the last good one, and rerunning the same command resumes from it.

A hang that holds the GIL (so that no Python thread runs, the watchdog's included) is caught
by a second, C-level timer (`faulthandler.dump_traceback_later`), re-armed at every sign of
progress, `timeout_s` plus a grace later: it writes the stacks to the same file and exits with
code 1, without the line.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from typing import Callable

EXIT_STALLED = 4
_GRACE_S = 60.0

# The training loop's methods, and what the loop waits for while inside one of them.
_WAITING_IN = {
    "next_batches": "waiting for training data",
    "flush_losses": "waiting for the device",
    "evaluate": "evaluating",
    "save": "checkpointing",
    "_restore_or_init": "restoring or initialising the state",
    "train_until_next_boundary": "dispatching ticks",
}


# How a stalled run's line says to resume: the command line's own resume command where the
# caller knows it (train.py sets "resume with: python train.py ... --workdir DIR").
RESUME_HINT: dict = {"text": None}


class StallWatchdog:
  """See the module docstring. `describe_checkpoint()` returns the newest-checkpoint part of
  the line (called only on a stall). `timeout_s <= 0` disables it."""

  def __init__(self, timeout_s: float, first_timeout_s: float, stacks_path: str,
               describe_checkpoint: Callable[[], str], *, exit_fn: Callable[[int], None]
               = os._exit):
    self.timeout_s = float(timeout_s)
    self.first_timeout_s = max(float(first_timeout_s), self.timeout_s)
    self.stacks_path = stacks_path
    self.describe_checkpoint = describe_checkpoint
    self._exit = exit_fn
    self._lock = threading.Lock()
    self._pending: list = []          # (step, array) dispatched, not seen complete yet
    self._completed: int | None = None  # the newest step seen complete
    self._last_progress = time.monotonic()
    self._compiling = True            # the first tick compiles
    self._stop = threading.Event()
    self._main = threading.main_thread().ident
    self._stacks_file = None
    self._thread = None
    self.enabled = self.timeout_s > 0

  # ---- the loop's side ----------------------------------------------------------------------
  def start(self, step: int | None) -> "StallWatchdog":
    self._completed = step
    if not self.enabled:
      return self
    self._thread = threading.Thread(target=self._watch, name="fdg_jax-stall-watchdog",
                                    daemon=True)
    self._thread.start()
    self._arm_backstop(self.first_timeout_s)
    return self

  def resumed(self, step: int | None) -> None:
    """The state was restored at `step` (None: freshly initialised); the clock restarts."""
    if self.enabled:
      with self._lock:
        self._completed = step
        self._last_progress = time.monotonic()

  def dispatched(self, step: int, output) -> None:
    """`output`: an array the ticks up to `step` produce (complete when it is ready)."""
    if self.enabled:
      with self._lock:
        self._pending.append((step, output))

  def beat(self) -> None:
    """Progress that is not a tick (an evaluation or a checkpoint done)."""
    if self.enabled:
      with self._lock:
        self._progress()

  def allow_compile(self) -> None:
    """The next wait may include a compilation: allow `first_timeout_s` until progress."""
    if self.enabled:
      with self._lock:
        self._compiling = True
        self._last_progress = time.monotonic()
      self._arm_backstop(self.first_timeout_s)

  def close(self) -> None:
    self._stop.set()
    # Joined, not left to die with the interpreter: a daemon thread that is still polling
    # (`is_ready`, C++ under the GIL's release) when Python finalises is ended by
    # pthread_exit, whose unwinding through jaxlib's frames aborts the process (SIGABRT,
    # "FATAL: exception not rethrown") after the run has finished.
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=30.0)
      self._thread = None
    if self.enabled:
      faulthandler.cancel_dump_traceback_later()
      if self._stacks_file is not None:
        self._stacks_file.close()
        self._stacks_file = None

  # ---- the watchdog's side ------------------------------------------------------------------
  def _progress(self) -> None:  # under the lock
    self._last_progress = time.monotonic()
    self._compiling = False
    self._arm_backstop(self.timeout_s)

  def _poll(self) -> None:
    with self._lock:
      while self._pending:
        step, out = self._pending[0]
        try:
          ready = out.is_ready()
        except Exception:  # noqa: BLE001  not an array of this process: count it as done
          ready = True
        if not ready:
          break
        self._pending.pop(0)
        self._completed = step
        self._progress()

  def _allowed(self) -> float:
    return self.first_timeout_s if self._compiling else self.timeout_s

  def _watch(self) -> None:
    interval = min(1.0, self.timeout_s / 4)
    while not self._stop.wait(interval):
      self._poll()
      with self._lock:
        idle = time.monotonic() - self._last_progress
        allowed = self._allowed()
      if idle > allowed:
        self._stalled(idle)
        return

  def _arm_backstop(self, seconds: float) -> None:
    if self._stacks_file is None:
      os.makedirs(os.path.dirname(os.path.abspath(self.stacks_path)), exist_ok=True)
      self._stacks_file = open(self.stacks_path + ".backstop", "w")
    faulthandler.dump_traceback_later(seconds + _GRACE_S, exit=True, file=self._stacks_file)

  def _where(self, frames) -> str:
    frame = frames.get(self._main)
    names = [f.name for f in traceback.extract_stack(frame)] if frame is not None else []
    for name in reversed(names):
      if name in _WAITING_IN:
        return _WAITING_IN[name]
    return "in " + names[-1] if names else "in an unknown place"

  def write_stacks(self) -> dict:
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    with open(self.stacks_path, "w") as f:
      f.write(f"Python stacks of every thread of process {os.getpid()} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
      for ident, frame in frames.items():
        f.write(f"\nThread {names.get(ident, '?')} ({ident})"
                f"{' [main]' if ident == self._main else ''}:\n")
        f.write("".join(traceback.format_stack(frame)))
    return frames

  def _stalled(self, idle: float) -> None:
    faulthandler.cancel_dump_traceback_later()
    try:
      frames = self.write_stacks()
      where = self._where(frames)
      stacks = f"stacks of every thread in {self.stacks_path}"
    except OSError as e:
      where, stacks = "in an unknown place", f"the stacks could not be written ({e})"
    after = ("before the first tick completed" if self._completed is None
             else f"after step {self._completed}")
    resume = RESUME_HINT["text"] or "rerun the same command to resume"
    print(f"error: run stalled: nothing completed for {idle:.0f} s {after} ({where}); "
          f"{stacks}; {self.describe_checkpoint()}; {resume} "
          f"(or raise --config.stall_timeout_s if a step is this slow)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    self._exit(EXIT_STALLED)
