"""Checkpoints of a run: an orbax manager over {schedule state, data position, progress}.

A checkpoint holds everything an exact resume needs (every stage's params, model state,
optimizer state and stash, the messages in flight, the tick, the data position). Restoring
takes the newest checkpoint that restores, setting unreadable ones aside; when none does,
`CheckpointError` (one line).

Each saved step's files get a sha256 each, in `<workdir>/checkpoint_checksums.json`; a
restore checks them first, so a step whose bytes changed on disk (bit rot, a bad copy) is
skipped like a corrupt one, with a line naming the file, and the run goes on from the one
before it. Steps written before checksums existed restore unchecked.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import sys
import time

import jax

from fdg_jax.config_check import UserError
from fdg_jax.runtime import arrays as runtime_arrays
from fdg_jax.trainer.metrics import log

CHECKPOINT_DIR = "checkpoints"
CHECKSUMS_FILE = "checkpoint_checksums.json"  # beside CHECKPOINT_DIR: {step: {file: sha256}}


class CheckpointError(UserError):
  """No checkpoint of the workdir can be restored."""


class ChecksumMismatch(Exception):
  """A checkpoint file's bytes differ from the sha256 written when it was saved."""


def _file_digests(directory: str) -> dict[str, str]:
  out = {}
  for root, _, files in os.walk(directory):
    for name in sorted(files):
      path = os.path.join(root, name)
      h = hashlib.sha256()
      with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
          h.update(chunk)
      out[os.path.relpath(path, directory)] = h.hexdigest()
  return out


class Checkpointer:
  """Orbax CheckpointManager over {schedule state, data position, progress}."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    if jax.process_count() > 1:
      runtime_arrays.single_replica_writes()
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    """The newest checkpoint's step (None: none yet)."""
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, progress: dict) -> None:
    """Writes the checkpoint of `step` and waits until it is on disk."""
    ocp = self._ocp
    # A write that fails (a full disk, a file-size limit) fails in each of orbax's writer
    # threads, which log it with its traceback; the same error reaches the caller, which
    # says it in one line (or re-raises what it cannot name).
    with _quiet_unraisable():
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(runtime_arrays.to_checkpoint(state)),
          data=ocp.args.JsonSave(data_state),
          progress=ocp.args.JsonSave(progress)), force=True)
      self.manager.wait_until_finished()
    if jax.process_index() == 0:
      self._write_checksums(step)

  @property
  def checksums_path(self) -> str:
    return os.path.join(os.path.dirname(self.directory), CHECKSUMS_FILE)

  def _read_checksums(self) -> dict:
    try:
      with open(self.checksums_path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return {}

  def _write_checksums(self, step: int) -> None:
    """The sha256 of every file of `step`, kept for the steps orbax keeps."""
    sums = self._read_checksums()
    sums[str(step)] = _file_digests(os.path.join(self.directory, str(step)))
    kept = {str(s) for s in self.manager.all_steps()}
    sums = {k: v for k, v in sums.items() if k in kept}
    tmp = self.checksums_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(sums, f, indent=0, sort_keys=True)
    os.replace(tmp, self.checksums_path)

  def verify(self, step: int) -> None:
    """ChecksumMismatch if a file of `step` is not what was saved (unchecked: no sums)."""
    expected = self._read_checksums().get(str(step))
    if not expected:
      return
    found = _file_digests(os.path.join(self.directory, str(step)))
    for name, digest in sorted(expected.items()):
      if found.get(name) != digest:
        raise ChecksumMismatch(f"{name} " + ("is missing" if name not in found else
                                             "differs from its checksum"))

  def restore_latest(self, target_state):
    """Restores the newest checkpoint that restores; None when there is none at all.

    A checkpoint that fails to restore (truncated or corrupt files) is reported in one line
    and skipped for the one before it; once one restores, the skipped ones are moved aside
    to `<workdir>/corrupt_checkpoints/` (the run will write those steps again). If none
    restores, CheckpointError, and nothing is moved or deleted.

    Returns:
      (step, state, data position, progress) or None.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    skipped = []
    for step in steps:
      try:
        with _quiet_unraisable():
          restored = self.restore(step, target_state)
      except Exception as e:  # noqa: BLE001  any failure to read means: try an older one
        first = (str(e).strip().splitlines() or [""])[0][:200]
        log(f"checkpoint step {step} in {self.directory} does not restore "
             f"({type(e).__name__}: {first}); trying the one before it")
        skipped.append(step)
        continue
      self._set_aside(skipped)
      return (step, *restored)
    if steps:
      raise CheckpointError(
          f"no checkpoint in {self.directory} restores (steps {steps}): corrupt, or written "
          "with another state layout (another config, or an fdg_jax version before a change "
          "of the stash; see the lines above); nothing was deleted: resume with what wrote "
          "them, move that folder away to start over, or restore it from a backup")
    return None

  def _set_aside(self, steps) -> None:
    """Moves the checkpoints of `steps` out of the manager's folder (kept, not deleted)."""
    if not steps:
      return
    aside = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints")
    if jax.process_index() == 0:
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(aside, f"{step}_{int(time.time())}")
        if os.path.exists(src):
          os.replace(src, dst)
          log(f"moved the unreadable checkpoint of step {step} to {dst}")
    self.manager.reload()

  def restore(self, step: int, target_state):
    """(state, data position, progress) of checkpoint `step`, in `target_state`'s layout."""
    ocp = self._ocp
    self.verify(step)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(runtime_arrays.checkpoint_target(target_state)),
        data=ocp.args.JsonRestore(),
        progress=ocp.args.JsonRestore()))
    state = runtime_arrays.from_checkpoint(restored["state"], target_state)
    return state, restored["data"], restored["progress"]

  def close(self):
    """Closes the orbax manager."""
    self.manager.close()


@contextlib.contextmanager
def _quiet_unraisable():
  """Silences the leftovers of a failed orbax restore or save (its exception says what
  failed).

  A restore that fails leaves orbax's pending read coroutines to be garbage-collected, now
  or at exit, and Python prints each one's traceback. From the first restore on, the
  process's unraisable hook drops the reports of orbax coroutines (and passes the rest on).
  """
  # The reads of a failed restore still in flight finish on tensorstore's threads, whose
  # callbacks find orbax's event loop closed and print tracebacks straight to file
  # descriptor 2: hold it on /dev/null while restoring, and give them a moment to land.
  sys.stderr.flush()
  saved_fd = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  failed = True
  if not getattr(sys.unraisablehook, "_drops_orbax_reads", False):
    previous = sys.unraisablehook

    def hook(unraisable):
      code = getattr(unraisable.object, "cr_code", None)
      if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return
      previous(unraisable)
    hook._drops_orbax_reads = True
    sys.unraisablehook = hook
    # ... and their tasks' "exception was never retrieved", logged by asyncio.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
  try:
    yield
    failed = False
  finally:
    if failed:
      time.sleep(0.5)
    gc.collect()
    sys.stderr.flush()
    os.dup2(saved_fd, 2)
    os.close(saved_fd)
    os.close(devnull)
