"""BatchIterator(workers=N): batches built in worker processes are bitwise those of
workers=0, in the same order, resume exactly, and close() leaves no worker behind."""

import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest

from fdg_jax import data
from fdg_jax.bench import data as bench_data


def _jpeg_imagenet(n=10, seed=0):
  """ImageNet-spec dataset of small variable-size JPEGs decoded per read (picklable)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(48, 97, (n, 2))
  jpegs = bench_data.synthetic_jpegs(sizes, rng)
  # pylint: disable-next=protected-access
  return bench_data._JpegDataset(jpegs, rng.integers(0, 1000, n))


def _list_imagenet(n=7, seed=1):
  rng = np.random.default_rng(seed)
  images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for h, w in rng.integers(40, 81, (n, 2))]
  labels = rng.integers(0, 1000, n)
  return bench_data._ListDataset(images, labels)  # pylint: disable=protected-access


def _cifar_like(n=30, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  return data.from_arrays(images, rng.integers(0, 10, n), like="cifar10")


class _FailingDataset(data.ArrayDataset):
  """Raises on reading example 3 (module level: picklable to the workers)."""

  def read(self, indices):
    if 3 in np.asarray(indices):
      raise KeyError("corrupt record 3")
    return super().read(indices)


def _take(it, k):
  return [next(it) for _ in range(k)]


def _assert_same(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.keys() == w.keys()
    for key in w:
      assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape, key
      assert g[key].tobytes() == w[key].tobytes(), key  # bitwise, -0.0 and NaN included


def _dead(pid, timeout=5.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone
      if f.read().split(")")[-1].split()[0] == "Z":
        return True
    time.sleep(0.05)
  return False


CASES = {
    # ImageNet spec, JPEG decode + random-resized crop + flip, 2.x epochs.
    "imagenet_jpeg_train": (_jpeg_imagenet, dict(batch_size=4, train=True, seed=3), 7),
    # ImageNet spec, resize/center crop, padded last batch with mask, one shard of two.
    "imagenet_eval_shard": (_list_imagenet, dict(batch_size=4, train=False, num_epochs=2,
                                                 process_index=1, process_count=2), 4),
    # In-memory cifar-like, pad/crop/flip, padded last batch, 2.x epochs.
    "cifar_train_padded": (_cifar_like, dict(batch_size=8, train=True, seed=5,
                                             drop_remainder=False), 10),
}


@pytest.mark.parametrize("case", list(CASES))
def test_workers_yield_bitwise_the_batches_of_workers_0(case):
  make_ds, kw, k = CASES[case]
  ds = make_ds()
  want = _take(data.BatchIterator(ds, workers=0, **kw), k)
  with data.BatchIterator(ds, workers=2, **kw) as it:
    got = _take(it, k)
    assert it.get_state() == data.BatchIterator(ds, **kw).get_state() | {
        "epoch": k // it.steps_per_epoch, "step": k % it.steps_per_epoch}
    if kw.get("num_epochs"):
      with pytest.raises(StopIteration):
        next(it)
  _assert_same(got, want)
  assert got[0]["image"].flags.writeable and got[0]["image"].flags.c_contiguous


def test_workers_resume_mid_epoch_exactly():
  ds = _jpeg_imagenet()
  kw = dict(batch_size=4, train=True, seed=11)
  want = _take(data.BatchIterator(ds, **kw), 7)  # 2 batches per epoch
  it = data.BatchIterator(ds, workers=2, **kw)
  _take(it, 3)  # mid-epoch 1, with batches 3.. queued in the workers
  state = json.loads(json.dumps(it.get_state()))
  assert (state["epoch"], state["step"]) == (1, 1)
  with data.BatchIterator(ds, workers=2, **kw) as restored:
    restored.set_state(state)
    _assert_same(_take(restored, 4), want[3:])
  serial = data.BatchIterator(ds, **kw)  # the state is the same across workers counts
  serial.set_state(state)
  _assert_same(_take(serial, 2), want[3:5])
  it.set_state({**state, "step": 0})  # rewinding drops the queued batches
  _assert_same(_take(it, 3), want[2:5])
  directory = it._procs.directory  # pylint: disable=protected-access
  it.close()
  assert not os.path.exists(directory)


def test_close_leaves_no_live_workers_and_the_iterator_restarts():
  ds = _cifar_like()
  before = set(multiprocessing.active_children())
  it = data.BatchIterator(ds, 8, train=True, seed=0, workers=2)
  first = next(it)
  pids, directory = it._procs.pids(), it._procs.directory  # pylint: disable=protected-access
  assert len(pids) == 2 and os.path.isdir(directory)
  it.close()
  assert all(_dead(pid) for pid in pids)
  assert set(multiprocessing.active_children()) <= before
  assert not os.path.exists(directory)
  assert first["image"].sum() != 0  # a yielded batch outlives the pool
  # Usable after close: a new pool continues from the position.
  want = data.BatchIterator(ds, 8, train=True, seed=0).batch_at(0, 1)
  _assert_same([next(it)], [want])
  pids = it._procs.pids()  # pylint: disable=protected-access
  del it  # garbage collection also stops the workers
  assert all(_dead(pid) for pid in pids)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_new_pool_removes_directories_left_by_killed_processes(tmp_path):
  import fcntl  # pylint: disable=g-import-not-at-top
  dirs = []
  for _ in range(2):
    d = tempfile.mkdtemp(prefix="fdg_data_999999999_", dir="/dev/shm")
    with open(os.path.join(d, ".lock"), "w"), open(os.path.join(d, "1_0_0_0"), "wb") as f:
      f.write(b"x" * 100)
    dirs.append(d)
  held = os.open(os.path.join(dirs[1], ".lock"), os.O_RDWR)
  fcntl.flock(held, fcntl.LOCK_EX)  # an owner still alive (e.g. another PID namespace)
  try:
    with data.BatchIterator(_cifar_like(), 8, train=True, workers=1) as it:
      next(it)
    assert not os.path.exists(dirs[0])
    assert os.path.exists(os.path.join(dirs[1], "1_0_0_0"))
  finally:
    os.close(held)
    shutil.rmtree(dirs[1], ignore_errors=True)


def test_unpicklable_dataset_is_a_clear_error():
  ds = _cifar_like()
  ds.transform = lambda x: x  # lambdas do not pickle
  with pytest.raises(ValueError, match="cannot be pickled.*use workers=0"):
    data.BatchIterator(ds, 8, train=True, workers=2)
  data.BatchIterator(ds, 8, train=True, workers=0)  # fine without workers
  with pytest.raises(ValueError, match="workers must be >= 0"):
    data.BatchIterator(_cifar_like(), 8, train=True, workers=-1)


def test_worker_exception_reaches_the_caller():
  base = _cifar_like(n=16)
  ds = _FailingDataset(base.images, base.labels, base.spec)
  with data.BatchIterator(ds, 4, train=False, workers=1) as it:
    want = [data.BatchIterator(base, 4, train=False).batch_at(0, 1)]
    with pytest.raises(KeyError, match="corrupt record 3"):
      next(it)  # batch 0 holds example 3
    assert (it.epoch, it.step) == (0, 0)
    it.set_state({"epoch": 0, "step": 1})
    _assert_same([next(it)], want)


def test_a_killed_worker_is_reported_and_the_pool_restarts():
  ds = _cifar_like()
  want = _take(data.BatchIterator(ds, 8, train=True, seed=1), 12)
  with data.BatchIterator(ds, 8, train=True, seed=1, workers=2) as it:
    got = _take(it, 2)
    os.kill(it._procs.pids()[0], signal.SIGKILL)  # pylint: disable=protected-access
    with pytest.raises(data.workers.WorkersBrokenError, match="worker process died"):
      for _ in range(8):  # up to 5 queued batches may be done already
        got.append(next(it))
    assert it._procs is None  # pylint: disable=protected-access
    got += _take(it, 12 - len(got))  # a new pool continues from the position
  _assert_same(got, want)


def test_bench_reports_images_per_second_against_workers(tmp_path, capsys):
  out = tmp_path / "bench.json"
  bench_data.main(["--num_examples", "0", "--imagenet", "64", "--prefetch", "0",
                   "--workers", "0", "2", "--jpeg_batches", "1", "--repeats", "1",
                   "--out", str(out)])
  lines = [l for l in capsys.readouterr().out.splitlines() if "workers=" in l]
  assert len(lines) == 3 and all("images/s" in l for l in lines)
  rows = [r for r in json.loads(out.read_text())["rows"] if r["source"] == "imagenet_jpeg"]
  assert [(r["workers"], r["prefetch"]) for r in rows] == [(0, 0), (0, 4), (2, 4)]
  assert all(r["images_per_s"] > 0 for r in rows)
