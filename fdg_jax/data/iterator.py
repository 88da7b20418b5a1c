"""Deterministic, resumable, shardable batch iterator over a ``Dataset``.

Every batch is a pure function of ``(seed, epoch, step)`` and the dataset: the order of
epoch ``e`` is a permutation drawn from ``(seed, e)`` only, and the augmentation of the
batch at ``(e, step)`` from ``(seed, e, step)`` only (parameters are drawn for the whole
global batch, row ``r`` getting the r-th draw). The iterator's state is therefore just
the position ``(epoch, step)``; restoring it reproduces the exact batches, augmentation
included, and it may even be restored under a different ``process_count``.

The pure function is `fdg_jax.data.batches.BatchMaker`; it runs in worker processes with
``workers=N`` (``workers.py``): the batches, their order and the state are exactly those
of ``workers=0``.
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any, Iterator

import numpy as np

from fdg_jax.data import workers as workers_lib
from fdg_jax.data.batches import BatchMaker, epoch_order
from fdg_jax.data.sources import ArrayDataset, Dataset

_STATE_VERSION = 1


class PositionedIterator(Iterator[dict[str, np.ndarray]]):
  """What `BatchIterator` and `fdg_jax.data.text.TextIterator` share: global batches of
  ``batch_size`` items in an order drawn from ``(seed, epoch)`` only, this process's rows
  of each, and the position ``(epoch, step)`` of the next batch as the whole state.

  Subclasses call `_init_position`, build batches in `batch_at` and define `get_state`.
  """

  def _init_position(self, num_items: int, batch_size: int, *, train: bool, seed: int,
                     drop_remainder: bool | None, shuffle: bool | None,
                     num_epochs: int | None, process_index: int, process_count: int) -> None:
    """Checks and sets the fields of the position (`steps_per_epoch` may be 0: the
    subclass says why in its own words)."""
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    if process_count <= 0 or not 0 <= process_index < process_count:
      raise ValueError(f"need 0 <= process_index < process_count, got {process_index} and "
                       f"{process_count}")
    if batch_size % process_count:
      raise ValueError(f"global batch_size {batch_size} is not divisible by process_count "
                       f"{process_count}")
    self._num_items = int(num_items)
    self.batch_size = int(batch_size)
    self.local_batch_size = self.batch_size // process_count
    self.train = bool(train)
    self.seed = int(seed)
    self.drop_remainder = self.train if drop_remainder is None else bool(drop_remainder)
    self.shuffle = self.train if shuffle is None else bool(shuffle)
    self.num_epochs = (None if self.train else 1) if num_epochs is None else int(num_epochs)
    self.process_index = int(process_index)
    self.process_count = int(process_count)
    n = self._num_items
    self.steps_per_epoch = (n // self.batch_size if self.drop_remainder
                            else -(-n // self.batch_size))
    self.epoch = 0
    self.step = 0
    self._orders: dict[int, np.ndarray] = {}

  def get_state(self) -> dict[str, Any]:
    raise NotImplementedError

  def _checked_position(self, state: dict[str, Any], keys) -> tuple[int, int]:
    """The position of a `get_state()` dict, after checking its `keys` against ours."""
    mine = self.get_state()
    for key in keys:
      if key in state and not _same(state[key], mine[key]):
        raise ValueError(f"iterator state has {key}={state[key]}, this iterator {mine[key]}")
    epoch, step = int(state["epoch"]), int(state["step"])
    if epoch < 0 or not 0 <= step < self.steps_per_epoch:
      raise ValueError(f"invalid position epoch={epoch} step={step} "
                       f"(steps_per_epoch={self.steps_per_epoch})")
    return epoch, step

  def order(self, epoch: int) -> np.ndarray:
    """Item indices of ``epoch`` in iteration order (int64 [N])."""
    order = self._orders.get(epoch)
    if order is None:
      n = self._num_items
      order = epoch_order(self.seed, epoch, n, self.shuffle)
      if len(self._orders) >= 2:  # keep the current and the next epoch
        self._orders.pop(min(self._orders))
      self._orders[epoch] = order
    return order

  def _finished(self, epoch: int) -> bool:
    return self.num_epochs is not None and epoch >= self.num_epochs

  def _advance(self) -> None:
    self.step += 1
    if self.step == self.steps_per_epoch:
      self.epoch, self.step = self.epoch + 1, 0

  def __iter__(self):
    return self

  def __len__(self) -> int:
    """Batches left until ``num_epochs`` ends (TypeError when it never ends)."""
    if self.num_epochs is None:
      raise TypeError(f"infinite {type(self).__name__} (num_epochs=None with train=True) "
                      "has no len")
    return max(0, (self.num_epochs - self.epoch) * self.steps_per_epoch - self.step)

  def __bool__(self) -> bool:  # not len()-based: an infinite iterator has no len
    return True

  def close(self) -> None:
    """Stops any background work (none here)."""

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _same(a, b) -> bool:
  """State fields compared as integers where they are, else as strings (a corpus hash)."""
  try:
    return int(a) == int(b)
  except (TypeError, ValueError):
    return str(a) == str(b)


class BatchIterator(PositionedIterator):
  """Yields ``{"image": float32 [b,H,W,C], "label": int32 [b]}`` (+ ``"mask"``) batches.

  Args:
    dataset: a ``Dataset`` (``load(...)`` / ``from_arrays(...)``).
    batch_size: the GLOBAL batch size B; each process yields ``b = B / process_count``
      rows (ValueError if not divisible).
    train: training mode: shuffle every epoch and augment by default.
    seed: seed of the shuffling and augmentation streams.
    drop_remainder: True: ``floor(N / B)`` full batches per epoch, the tail dropped.
      False: ``ceil(N / B)`` batches, the last one padded with zero images and label 0,
      and every batch carries ``"mask"`` (float32 [b], 1 = real example, 0 = padding).
      None: True when ``train`` else False (evaluation sees every example exactly once).
    process_index, process_count: this process yields rows
      ``[process_index * b, (process_index + 1) * b)`` of every global batch.
    augment: apply the dataset's training augmentation (registry); None = ``train``.
    shuffle: None = ``train``; False iterates in dataset order.
    num_epochs: stop after this many epochs; None = never stop when ``train``, one epoch
      otherwise.
    prefetch: number of upcoming batches prepared by background threads (0: none, all
      work on the calling thread). None: 0 for in-memory datasets (``ArrayDataset``: the
      work is a few numpy passes, and on a busy 2-core machine threads measured slower),
      4 for datasets read/decoded per batch (TFDS sources, ImageNet), where threads help.
    workers: number of worker processes building whole upcoming batches (0: none, the
      behaviour above). Use it for ImageNet, where JPEG decoding and crops are CPU-bound
      (a few hundred images/s per process under the GIL): images/s then grow with the
      workers up to the CPU cores. Every worker runs the same pure function of
      ``(seed, epoch, step)``, so the batches, their order and ``get_state()`` are exactly
      those of ``workers=0`` (resume is exact, across any ``workers``). With workers, the
      number of batches queued ahead is ``max(prefetch, 2 * workers)`` (two per worker
      keep every worker busy while the consumer takes one), no prefetch threads, and the
      ``"image"`` arrays are read-write views of shared memory (``/dev/shm``; each queued
      batch holds one there). The dataset is pickled to every worker once (ValueError if
      it cannot be pickled: use workers=0); worker start-up takes about a second, on the
      first batch. See ``fdg_jax.data.workers`` for the design.

  The iterator continues across epochs; ``epoch``/``step`` give the position of the next
  batch, ``get_state()``/``set_state()`` save and restore it. ``close()`` (or a ``with``
  block) stops the prefetch threads or worker processes.
  """

  def __init__(self, dataset: Dataset, batch_size: int, *, train: bool, seed: int = 0,
               drop_remainder: bool | None = None, process_index: int = 0,
               process_count: int = 1, augment: bool | None = None,
               shuffle: bool | None = None, num_epochs: int | None = None,
               prefetch: int | None = None, workers: int = 0):
    self._init_position(dataset.num_examples, batch_size, train=train, seed=seed,
                        drop_remainder=drop_remainder, shuffle=shuffle,
                        num_epochs=num_epochs, process_index=process_index,
                        process_count=process_count)
    self.dataset = dataset
    self.spec = dataset.spec
    self.augment = self.train if augment is None else bool(augment)
    if self.steps_per_epoch == 0:
      raise ValueError(f"{dataset.name}/{dataset.split} has {dataset.num_examples} examples: "
                       f"not one full batch of {self.batch_size} (use drop_remainder=False)")
    if prefetch is None:
      prefetch = 0 if isinstance(dataset, ArrayDataset) else 4
    self._prefetch = max(0, int(prefetch))
    if int(workers) < 0:
      raise ValueError(f"workers must be >= 0, got {workers}")
    self._workers = int(workers)
    if self._workers:
      workers_lib.pickle_dataset(dataset)  # fail now, not at the first batch
      self._prefetch = max(self._prefetch, 2 * self._workers)
    self._pool = None
    self._procs: workers_lib.ProcessBatchPool | None = None
    self._pending: collections.deque = collections.deque()

  # ---- position / state ---------------------------------------------------------------

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """``(H, W, C)`` of the yielded images."""
    return self.dataset.image_shape

  def get_state(self) -> dict[str, Any]:
    """JSON-able state: the position of the next batch plus fields checked on restore."""
    return {"version": _STATE_VERSION, "epoch": self.epoch, "step": self.step,
            "seed": self.seed, "batch_size": self.batch_size,
            "num_examples": self.dataset.num_examples,
            "drop_remainder": int(self.drop_remainder), "shuffle": int(self.shuffle)}

  def set_state(self, state: dict[str, Any]) -> None:
    """Restores a ``get_state()`` position; the next batch is the one an uninterrupted
    iterator would yield there. ValueError if seed, global batch size, dataset size,
    drop_remainder or shuffle differ (``process_count`` may differ)."""
    epoch, step = self._checked_position(state, ("version", "seed", "batch_size",
                                                 "num_examples", "drop_remainder", "shuffle"))
    self._drop_pending()
    self.epoch, self.step = epoch, step

  # ---- batch construction -------------------------------------------------------------

  def batch_at(self, epoch: int, step: int) -> dict[str, np.ndarray]:
    """This process's batch at position ``(epoch, step)``; a pure function of it."""
    return self._make_batch(epoch, step, self.order(epoch))

  def batch_maker(self) -> BatchMaker:
    """What builds this iterator's batches (its worker processes hold a copy)."""
    return BatchMaker(self.dataset, self.batch_size, self.local_batch_size,
                      self.process_index, self.seed, self.augment, self.drop_remainder,
                      self.shuffle)

  def _make_batch(self, epoch: int, step: int, order: np.ndarray) -> dict[str, np.ndarray]:
    """The batch at ``(epoch, step)`` of the epoch's ``order``, in a new array."""
    return self.batch_maker().make(epoch, step, order)

  # ---- iteration ----------------------------------------------------------------------

  def _positions_from(self, epoch: int, step: int):
    while not self._finished(epoch):
      yield epoch, step
      step += 1
      if step == self.steps_per_epoch:
        epoch, step = epoch + 1, 0

  def _drop_pending(self) -> None:
    for _, fut in self._pending:
      if self._procs is not None:
        self._procs.discard(fut)
      else:
        fut.cancel()
    self._pending.clear()

  def _submit(self, epoch: int, step: int):
    if self._procs is not None:
      return self._procs.submit(epoch, step)  # the worker computes the order
    order = self.order(epoch)  # computed on this thread
    return self._pool.submit(self._make_batch, epoch, step, order)

  def _start(self) -> None:
    if self._workers:
      if self._procs is None:
        self._procs = workers_lib.ProcessBatchPool(self.batch_maker(), self._workers,
                                                   self._prefetch)
    elif self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          max_workers=min(self._prefetch, 4), thread_name_prefix="fdg_data")

  def _result(self, fut) -> dict[str, np.ndarray]:
    return fut.result() if self._procs is None else self._procs.result(fut)

  def _next_prefetched(self, pos: tuple[int, int]) -> dict[str, np.ndarray]:
    self._start()
    if self._pending and self._pending[0][0] != pos:
      self._drop_pending()
    if not self._pending:
      self._pending.append((pos, self._submit(*pos)))
    last = self._pending[-1][0]
    positions = self._positions_from(*last)
    next(positions)
    for p in positions:
      if len(self._pending) > self._prefetch:
        break
      self._pending.append((p, self._submit(*p)))
    return self._result(self._pending.popleft()[1])

  def __next__(self) -> dict[str, np.ndarray]:
    if self._finished(self.epoch):
      raise StopIteration
    pos = (self.epoch, self.step)
    if self._prefetch:
      try:
        batch = self._next_prefetched(pos)
      except workers_lib.WorkersBrokenError:  # start a new pool on the next call
        self._close_procs(wait=False)
        raise
    else:
      batch = self.batch_at(*pos)
    self._advance()
    return batch

  def _close_procs(self, wait: bool) -> None:
    self._drop_pending()
    if self._procs is not None:
      procs, self._procs = self._procs, None
      procs.close(wait=wait)

  def close(self) -> None:
    """Stops the prefetch threads or worker processes and waits for them (the iterator
    can still be used afterwards: they restart on the next batch)."""
    self._close_procs(wait=True)
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None

  def __del__(self):
    try:
      self._close_procs(wait=False)
      if self._pool is not None:
        self._pool.shutdown(wait=False, cancel_futures=True)
    except Exception:  # pylint: disable=broad-except
      pass
