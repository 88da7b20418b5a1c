"""How the schedule benchmarks time: a schedule brought to its steady state (`prepare`), the
repetitions of several schedules interleaved (`time_interleaved`), the median and spread of
repeated measurements (`spread`), and the host thread alone on a core (`host_thread_pinned`).

Every timed region ends with `jax.block_until_ready` (`block`); compilation is excluded by
the warm-up ticks; the repetitions of the schedules compared in one table are interleaved
(round-robin), so that load from other processes hits them alike.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from typing import Sequence


def spread(values: Sequence[float]) -> dict:
  """median, min, max and relative spread (max - min) / median of repeated measurements."""
  med = statistics.median(values)
  return {"median": med, "min": min(values), "max": max(values),
          "rel_spread": (max(values) - min(values)) / med if med > 0 else 0.0,
          "values": list(values)}


def block(tree) -> None:
  """Waits for every device array in `tree` (host values are skipped)."""
  import jax
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, "block_until_ready"):
      leaf.block_until_ready()


def prepare(schedule, params, states, batch, warmup: int | None = None,
            run_ticks: int | None = None) -> dict:
  """A schedule in its steady state, ready for `time_interleaved`.

  Runs `warmup` ticks (default 2(K-1)+2: past the pipeline fill, where the last per-stage
  variants compile) and blocks. With `run_ticks` = T the schedule is timed through
  `schedule.run` on T stacked copies of `batch` (placed once, like the batch), else through
  `schedule.step`.
  """
  import jax
  K = schedule.num_stages
  warmup = 2 * (K - 1) + 2 if warmup is None else warmup
  state = schedule.init(params, states, example_batch=batch)
  entry = {"schedule": schedule, "batch": batch, "run_ticks": run_ticks}
  t0 = time.perf_counter()
  if run_ticks:
    stack = lambda a: jax.numpy.stack([a] * run_ticks)
    entry["stacked"] = jax.tree.map(stack, batch)
    block(entry["stacked"])
    t0 = time.perf_counter()
    state, m = schedule.run(state, entry["stacked"])
    block((state["stages"], m))
    t1 = time.perf_counter()
    state, m = schedule.run(state, entry["stacked"])
  else:
    m = {}
    for _ in range(warmup):
      state, m = schedule.step(state, batch)
    t1 = time.perf_counter()
  block((state["stages"], state.get("inbox"), m))
  # The first call (run) or the warm-up ticks (step): compilation, plus that much compute.
  entry.update(state=state, metrics=m, warmup_s=t1 - t0)
  return entry


def _advance(entry, ticks: int):
  """`ticks` ticks of a prepared entry (by `step`, or by `run` calls of its T ticks)."""
  schedule, state, m = entry["schedule"], entry["state"], entry["metrics"]
  T = entry["run_ticks"]
  if T:
    for _ in range(max(ticks // T, 1)):
      state, m = schedule.run(state, entry["stacked"])
  else:
    for _ in range(ticks):
      state, m = schedule.step(state, entry["batch"])
  return state, m


def _last_loss(m) -> float:
  loss = m["loss"]
  return float(loss[-1] if getattr(loss, "ndim", 0) else loss)


@contextlib.contextmanager
def host_thread_pinned(enabled: bool = True):
  """Within the block, the calling thread alone on the first of this process's cores and
  every other thread (the runtime's pools, which run XLA:CPU's device programs) on the
  others; their affinities are restored after it. Linux only.

  On a CPU platform the host thread and the devices share the cores: the moment a call
  hands a program to the pool, a worker can take the caller's core, and the time for the
  call to return then counts device work. Pinned, device work no longer takes the caller's
  core, as on an accelerator (a call can still wait on the runtime, e.g. its limit on
  computations in flight), and the devices get one core fewer, so blocked times rise.
  Threads the caller starts inside the block inherit its core.
  """
  if not enabled:
    yield
    return
  if not hasattr(os, "sched_setaffinity"):
    raise SystemExit("--pin_host needs Linux thread affinities (os.sched_setaffinity)")
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < 2:
    raise SystemExit(f"--pin_host needs at least 2 cores; this process may use {len(cores)}")
  me, saved = threading.get_native_id(), {}
  for name in os.listdir("/proc/self/task"):
    tid = int(name)
    with contextlib.suppress(OSError):  # a thread that ended meanwhile
      saved[tid] = os.sched_getaffinity(tid)
      os.sched_setaffinity(tid, cores[:1] if tid == me else cores[1:])
  try:
    yield
  finally:
    for tid, mask in saved.items():
      with contextlib.suppress(OSError):
        os.sched_setaffinity(tid, mask)


def time_interleaved(entries: Sequence[dict], *, ticks: int, repeats: int) -> list[dict]:
  """Per-tick seconds of every prepared schedule, the repetitions taken round-robin.

  Interleaving puts every schedule's i-th repetition next to the others' in time, so a slow
  spell of a shared machine hits all of them alike (and per-repetition ratios cancel it).
  Returns, per entry, `step` (blocked at the end of each repetition), `host` (the time for
  the calls to return, before blocking) and `host_cpu` (the calling thread's CPU time over
  those calls: its own work, without the time it waited or was preempted) lists, and
  whether the last loss is finite. An
  entry timed through `run` takes ticks // T calls of T ticks (at least one).
  """
  out = [{"step": [], "host": [], "host_cpu": [], "host_idle": []} for _ in entries]
  for _ in range(repeats):
    for e, o in zip(entries, out):
      n = max(ticks // e["run_ticks"], 1) * e["run_ticks"] if e["run_ticks"] else ticks
      t0, c0 = time.perf_counter(), time.thread_time()
      state, m = _advance(e, ticks)
      t1, c1 = time.perf_counter(), time.thread_time()
      block((state["stages"], state.get("inbox"), m))
      t2 = time.perf_counter()
      e["state"], e["metrics"] = state, m
      o["host"].append((t1 - t0) / n)
      o["host_cpu"].append((c1 - c0) / n)
      o["step"].append((t2 - t0) / n)
      # One call with the devices idle: the host's own cost, not slowed by device work
      # competing for the same cores (XLA:CPU) or by a full dispatch queue.
      t0 = time.perf_counter()
      state, m = _advance(e, e["run_ticks"] or 1)
      t1 = time.perf_counter()
      block((state["stages"], state.get("inbox"), m))
      e["state"], e["metrics"] = state, m
      o["host_idle"].append((t1 - t0) / (e["run_ticks"] or 1))
  for e, o in zip(entries, out):
    o["loss_finite"] = math.isfinite(_last_loss(e["metrics"]))
  return out
