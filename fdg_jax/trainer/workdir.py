"""A run's workdir: one run at a time (a lock), and its failures to be written in one line.

`WorkdirLock` takes an exclusive `flock` on `<workdir>/run.lock` before anything else is
written there, and holds it for the whole run. The kernel releases it when the process
ends, however it ends (kill -9 included), so a lock left by a dead run is simply taken over,
with a line naming the process that held it. A second run on the same workdir is refused
at once, in one line naming the process that holds it. In a multi-process run, process 0
holds it for all.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time

from fdg_jax.config_check import UserError
from fdg_jax.trainer.metrics import log

LOCK_FILE = "run.lock"
# The errors of a write that the user can act on (space, limits, permissions, names).
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                          errno.EPERM, errno.ENAMETOOLONG, errno.ENOTDIR, errno.EEXIST})


class WorkdirInUse(UserError):
  """Another live process is training in this workdir."""


def os_error_line(e: OSError, workdir: str, doing: str) -> str:
  """One line for an OSError met while `doing` in `workdir`, and what to do about it."""
  what = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EFBIG: "a file exceeds the size limit (ulimit -f)",
          errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
          errno.EPERM: "permission denied", errno.ENAMETOOLONG: "a name is too long",
          errno.ENOTDIR: "a part of the path is a file, not a folder",
          errno.EEXIST: "a file of that name exists"}.get(e.errno, e.strerror or str(e))
  return (f"cannot write the run's files ({doing}) in {workdir}: {what}"
          + (f" ({e.filename})" if getattr(e, "filename", None) else "")
          + "; free space or choose another --workdir; the last checkpoint, if any, is kept")


class WorkdirLock:
  """The exclusive lock of a workdir for the life of one run (`with WorkdirLock(dir):`)."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.workdir, self.enabled, self.file = workdir, enabled, None

  def __enter__(self):
    if not self.enabled:
      return self
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise UserError(f"--workdir {self.workdir} is a file, not a folder; choose another "
                      "--workdir")
    path = os.path.join(self.workdir, LOCK_FILE)
    try:
      os.makedirs(self.workdir, exist_ok=True)
      self.file = open(path, "a+")
    except OSError as e:
      raise UserError(os_error_line(e, self.workdir, "creating it")) from None
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _holder(self.file)
      self.file.close()
      self.file = None
      who = (f"process {holder['pid']} (started {holder.get('started', '?')})" if holder
             else "another process")
      raise WorkdirInUse(f"workdir {self.workdir} is in use by {who}; wait for that run to "
                         "end, stop it, or use another --workdir") from None
    previous = _holder(self.file)
    if previous and previous.get("pid") != os.getpid() and not previous.get("released"):
      log(f"took over the lock of {self.workdir} from process {previous['pid']}, which ended "
          "without releasing it")
    self._write({"pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    return self

  def _write(self, content: dict) -> None:
    try:
      self.file.seek(0)
      self.file.truncate()
      self.file.write(json.dumps(content) + "\n")
      self.file.flush()
    except OSError:
      pass  # the lock itself holds: what it says about its holder is a courtesy

  def __exit__(self, *exc):
    if self.file is not None:
      self._write({"pid": os.getpid(), "released": True})
      fcntl.flock(self.file, fcntl.LOCK_UN)
      self.file.close()
      self.file = None
    return False


def _holder(f) -> dict | None:
  try:
    f.seek(0)
    text = f.read().strip()
    return json.loads(text) if text else None
  except (OSError, ValueError):
    return None
