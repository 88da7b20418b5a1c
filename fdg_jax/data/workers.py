"""Worker processes behind ``BatchIterator(..., workers=N)``.

Decoding ImageNet JPEGs and random-resized crops run at a few hundred images/s per process
under the GIL; this module builds upcoming batches in ``N`` worker processes instead.

Design (and why):

* **One task = one whole batch position** ``(epoch, step)``. Every worker unpickles the
  iterator's ``BatchMaker`` (``batches.py``: the dataset and the settings) once (pool
  initializer) and runs the same pure function as ``workers=0``; it recomputes the epoch
  order from ``(seed, epoch)`` itself, so a task is two integers. Batches are therefore
  bitwise those of ``workers=0``, yielded in the same order, and the iterator state is
  still just the position. Splitting one batch's images across the workers was the other
  option; it is not used because it only shortens the latency of a single batch (which
  the prefetch queue hides anyway) while adding per-chunk messages, a gather and the
  normalisation pass in the parent, whose one core then caps the images/s.
* **Images come back through shared memory, without copies.** A worker writes the
  normalised float32 batch straight into a fresh file in ``/dev/shm`` (the temp directory
  if ``/dev/shm`` is missing or too small), the parent maps it and unlinks the name at
  once: the yielded ``"image"`` array *is* that mapping, freed with the array. Labels and
  mask are pickled. (Piping a pickled 256 x 224 x 224 x 3 float32 batch through a
  ``ProcessPoolExecutor`` result measured ~0.5 s per batch on the 2-core machine, about as
  long as decoding it.)
* **forkserver** start method (spawn where it is missing), never fork: the parent has JAX
  initialised and runs threads. The forkserver preloads this module (numpy, fdg_jax; no
  JAX backend is started), so a worker starts in a fraction of a second plus the time to
  unpickle the dataset; with spawn, about a second. Ctrl-C is left to the parent.
* **Clean-up.** The parent unlinks each consumed batch file at once, those of dropped
  positions (``set_state``, errors) when their task ends, and the directory on
  ``close()``; an exiting worker removes the directory too, and a worker whose parent
  died (a thread waits on the parent's sentinel) removes it and exits. A directory left
  anyway (parent and workers killed together) is removed by the next pool that starts:
  its lock file (flock, held by the parent) is free.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import shutil
import signal
import tempfile
import threading
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

try:
  import fcntl  # pylint: disable=g-import-not-at-top
except ImportError:  # not POSIX: no clean-up of stale batch directories
  fcntl = None

_SHM_ROOT = "/dev/shm"
_PREFIX = "fdg_data_"
_LOCK = ".lock"


class WorkersBrokenError(RuntimeError):
  """A worker process died; the pool is unusable (``BatchIterator`` starts a new one on
  the next batch)."""


_BROKEN = ("a BatchIterator worker process died (killed, out of memory, or the dataset "
           "could not be rebuilt in a fresh process); retry, lower workers, or use workers=0")


def start_method() -> str:
  """``"forkserver"`` where available (Linux, macOS), else ``"spawn"``; never ``"fork"``."""
  return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _context() -> multiprocessing.context.BaseContext:
  method = start_method()
  ctx = multiprocessing.get_context(method)
  if method == "forkserver":
    # Workers fork from a server that has imported numpy and fdg_jax already: start-up
    # in ~0.1 s instead of ~1 s. Only read when the (process-wide) server first starts;
    # modules asked for by others are kept.
    from multiprocessing import forkserver  # pylint: disable=g-import-not-at-top
    server = forkserver._forkserver  # pylint: disable=protected-access
    modules = list(getattr(server, "_preload_modules", None) or ["__main__"])
    if __name__ not in modules:
      ctx.set_forkserver_preload(modules + [__name__])
  return ctx


def pickle_dataset(dataset, holder=None) -> bytes:
  """``holder`` (default: the dataset itself), holding ``dataset``, as sent to every
  worker; ValueError (use workers=0) if it cannot be pickled."""
  try:
    return pickle.dumps(dataset if holder is None else holder,
                        protocol=pickle.HIGHEST_PROTOCOL)
  except Exception as err:  # pylint: disable=broad-except
    raise ValueError(
        f"BatchIterator(workers>0) sends the dataset to worker processes, but this "
        f"{type(dataset).__name__} cannot be pickled ({type(err).__name__}: {err}); "
        f"use workers=0") from err


def _batch_dir(needed_bytes: int) -> tuple[str, int | None]:
  """A fresh private directory for batch files, in /dev/shm if it has room for
  ``needed_bytes``, else in the temp directory; and the fd of its lock file, locked by
  this process for the directory's lifetime (None without fcntl)."""
  root = tempfile.gettempdir()
  if os.path.isdir(_SHM_ROOT) and os.access(_SHM_ROOT, os.W_OK):
    _remove_stale_dirs(_SHM_ROOT)
    st = os.statvfs(_SHM_ROOT)
    if st.f_bavail * st.f_frsize >= needed_bytes:
      root = _SHM_ROOT
  if root != _SHM_ROOT:
    _remove_stale_dirs(root)
  directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}_", dir=root)
  if fcntl is None:
    return directory, None
  fd = os.open(os.path.join(directory, _LOCK), os.O_CREAT | os.O_RDWR, 0o600)
  fcntl.flock(fd, fcntl.LOCK_EX)
  return directory, fd


def _remove_stale_dirs(root: str) -> None:
  """Removes the batch directories of processes that died before any clean-up could run
  (killed together with their workers): those whose lock file nobody holds. A lock, not
  a pid, so that other PID namespaces sharing /dev/shm are safe."""
  if fcntl is None:
    return
  try:
    names = [n for n in os.listdir(root) if n.startswith(_PREFIX)]
  except OSError:
    return
  for name in names:
    directory = os.path.join(root, name)
    try:
      fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR)
    except OSError:  # being created, or not ours to open
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its owner is alive
      os.close(fd)
      continue
    shutil.rmtree(directory, ignore_errors=True)
    os.close(fd)


def _shutdown(executor: concurrent.futures.ProcessPoolExecutor, directory: str,
              lock_fd: int | None) -> None:
  executor.shutdown(wait=True, cancel_futures=True)
  shutil.rmtree(directory, ignore_errors=True)
  if lock_fd is not None:
    os.close(lock_fd)


def _unlink(path: str) -> None:
  try:
    os.unlink(path)
  except FileNotFoundError:
    pass


def _discard(future: concurrent.futures.Future) -> None:
  """Done-callback of a dropped task: removes its batch file, if it made one."""
  if not future.cancelled() and future.exception() is None:
    _unlink(future.result()[0])


class ProcessBatchPool:
  """``workers`` processes building the batches of ``maker`` (a ``BatchMaker``).

  ``submit(epoch, step)`` returns a future; ``result(future)`` turns it into the batch
  dict; ``discard(future)`` drops one that will not be consumed; ``close()`` shuts down.
  """

  def __init__(self, maker, workers: int, depth: int):
    self.shape = (maker.local_batch_size,) + tuple(maker.dataset.image_shape)
    self.nbytes = int(np.prod(self.shape)) * np.dtype(np.float32).itemsize
    # Room for the queued batches plus as many held by the consumer.
    self.directory, self._lock_fd = _batch_dir(2 * (depth + workers + 1) * self.nbytes)
    try:
      self._executor = concurrent.futures.ProcessPoolExecutor(
          max_workers=workers, mp_context=_context(),
          initializer=_init_worker,
          initargs=(pickle_dataset(maker.dataset, maker), self.directory, self.shape))
    except BaseException:
      shutil.rmtree(self.directory, ignore_errors=True)
      if self._lock_fd is not None:
        os.close(self._lock_fd)
      raise
    # Joins the workers and removes the directory on close(wait=True), on garbage
    # collection, or at interpreter exit (before modules are torn down).
    self._closer = weakref.finalize(self, _shutdown, self._executor, self.directory,
                                    self._lock_fd)

  @property
  def closed(self) -> bool:
    return not self._closer.alive

  def submit(self, epoch: int, step: int) -> concurrent.futures.Future:
    try:
      return self._executor.submit(_build, int(epoch), int(step))
    except BrokenProcessPool as err:
      raise WorkersBrokenError(_BROKEN) from err

  def result(self, future: concurrent.futures.Future) -> dict[str, np.ndarray]:
    """The batch of a submitted task (waits for it). A worker's exception is re-raised;
    a dead worker raises ``WorkersBrokenError``."""
    try:
      path, rest = future.result()
    except BrokenProcessPool as err:
      raise WorkersBrokenError(_BROKEN) from err
    fd = os.open(path, os.O_RDWR)
    try:
      buf = mmap.mmap(fd, self.nbytes)
    finally:
      os.close(fd)
      _unlink(path)
    return {"image": np.frombuffer(buf, np.float32).reshape(self.shape), **rest}

  def discard(self, future: concurrent.futures.Future) -> None:
    future.cancel()
    if not self.closed:  # else the directory is gone already
      future.add_done_callback(_discard)

  def pids(self) -> list[int]:
    """Process ids of the live workers (started on the first ``submit``)."""
    processes = self._executor._processes or {}  # pylint: disable=protected-access
    return [p.pid for p in list(processes.values())]

  def close(self, wait: bool = True) -> None:
    """Stops the workers (queued tasks are cancelled). With ``wait``, joins them and
    removes the batch directory; without, the exiting workers remove it."""
    if wait:
      self._closer()
    elif self._closer.detach() is not None:
      self._executor.shutdown(wait=False, cancel_futures=True)
      if self._lock_fd is not None:  # the directory is stale once the workers exit
        os.close(self._lock_fd)


# ---- worker side ----------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(payload: bytes, directory: str, shape: tuple) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent shuts us down
  _WORKER.update(directory=directory, shape=shape, names=itertools.count())
  # Leftover batch files are garbage once the workers stop (the parent consumes none
  # after shutting the pool down).
  multiprocessing.util.Finalize(None, shutil.rmtree, args=(directory,),
                                kwargs={"ignore_errors": True}, exitpriority=0)
  threading.Thread(target=_watch_parent, args=(directory,), daemon=True,
                   name="fdg_data_watch").start()
  try:
    _WORKER["maker"] = pickle.loads(payload)
  except BaseException as err:  # pylint: disable=broad-except
    _WORKER["error"] = err  # reported by every task (an initializer error would only
    # print in the worker and leave a "broken pool" in the parent)


def _watch_parent(directory: str) -> None:
  """Removes the batch files and exits when the parent process dies (the pool's queues
  alone would leave the worker waiting forever)."""
  parent = multiprocessing.parent_process()
  if parent is None:
    return
  multiprocessing.connection.wait([parent.sentinel])  # readable (EOF) once it is gone
  shutil.rmtree(directory, ignore_errors=True)
  os._exit(0)  # pylint: disable=protected-access


def _build(epoch: int, step: int) -> tuple[str, dict[str, np.ndarray]]:
  """Builds batch ``(epoch, step)`` with its image in a new file; returns the file's path
  and the other entries."""
  err = _WORKER.get("error")
  if err is not None:
    raise ValueError(f"BatchIterator worker could not rebuild the dataset: "
                     f"{type(err).__name__}: {err}; use workers=0") from err
  shape = _WORKER["shape"]
  nbytes = int(np.prod(shape)) * np.dtype(np.float32).itemsize
  path = os.path.join(_WORKER["directory"],
                      f"{os.getpid()}_{epoch}_{step}_{next(_WORKER['names'])}")
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    _reserve(fd, nbytes, path)
    buf = mmap.mmap(fd, nbytes)
  except BaseException:
    _unlink(path)
    raise
  finally:
    os.close(fd)
  try:
    rest = _fill(buf, shape, epoch, step)
  except BaseException:
    _unlink(path)
    raise
  finally:
    try:
      buf.close()
    except BufferError:  # an exception's traceback still views it: unmapped with it
      pass
  return path, rest


def _reserve(fd: int, nbytes: int, path: str) -> None:
  """Allocates the file's memory now: a full /dev/shm is an error here, not a SIGBUS."""
  if not hasattr(os, "posix_fallocate"):
    os.ftruncate(fd, nbytes)
    return
  try:
    os.posix_fallocate(fd, 0, nbytes)
  except OSError as err:
    raise OSError(err.errno, f"no room for a {nbytes / 2**20:.0f} MiB batch in "
                  f"{os.path.dirname(path)} ({err.strerror}): free memory there, lower "
                  f"workers/prefetch, or use workers=0") from None


def _fill(buf: mmap.mmap, shape: tuple, epoch: int, step: int) -> dict[str, np.ndarray]:
  maker = _WORKER["maker"]
  out = np.frombuffer(buf, np.float32).reshape(shape)
  batch = maker.make(epoch, step, maker.order(epoch), out=out)
  return {k: v for k, v in batch.items() if k != "image"}
