"""The schedule benchmarks' former single module, kept so that `from fdg_jax.bench import
schedules` goes on working: it re-exports the names it held, which now live one module per
benchmark:

  common       the schedules run (read from the registry), models, stages, batches,
               optimiser, loss, placement, the machine's description
  timing       prepare, time_interleaved, spread, block, host_thread_pinned
  throughput   bench_throughput, host_calls_per_tick, throughput_table
  overhead     bench_overhead, overhead_table
  dispatch     bench_dispatch, dispatch_table
  memory       bench_memory, memory_table
  speedup      stage_times, transfer_time, predict, bench_speedup, speedup_table
  cli          parse_args, run, main (`python -m fdg_jax.bench`)

New code imports those modules.
"""

import sys

from fdg_jax.bench import common
from fdg_jax.bench.cli import main, parse_args, run
from fdg_jax.bench.common import (ALGORITHMS, DEFAULT_INPUT_SHAPE, DEFAULT_MODEL_KWARGS, PLANS,
                                  POLICIES, PRESETS, SYNC, TINY, build_model, build_stages,
                                  device_info, jax_leaves, loss_fn, make_schedule, mesh_for,
                                  optimizer, placement_for, random_batch, tree_bytes,
                                  write_figures)
from fdg_jax.bench.dispatch import bench_dispatch, dispatch_table
from fdg_jax.bench.memory import bench_memory, memory_table
from fdg_jax.bench.overhead import bench_overhead, overhead_table
from fdg_jax.bench.speedup import (bench_speedup, predict, speedup_table, stage_times,
                                   transfer_time)
from fdg_jax.bench.throughput import bench_throughput, host_calls_per_tick, throughput_table
from fdg_jax.bench.timing import block, host_thread_pinned, prepare, spread, time_interleaved

__all__ = [
    "ALGORITHMS", "DEFAULT_INPUT_SHAPE", "DEFAULT_MODEL_KWARGS", "PLANS", "POLICIES", "PRESETS",
    "SYNC", "TINY", "bench_dispatch", "bench_memory", "bench_overhead", "bench_speedup",
    "bench_throughput", "block", "build_model", "build_stages", "device_info",
    "dispatch_table", "host_calls_per_tick", "host_thread_pinned", "jax_leaves", "loss_fn",
    "main", "make_schedule", "memory_table", "mesh_for", "optimizer", "overhead_table",
    "parse_args", "placement_for", "predict", "prepare", "random_batch", "run",
    "speedup_table", "spread", "stage_times", "throughput_table", "time_interleaved",
    "transfer_time", "tree_bytes", "write_figures"]


def __getattr__(name):
  # The compute dtype `run` sets (--dtype) lives in `common`: read it there, not a copy.
  if name == "COMPUTE_DTYPE":
    return common.COMPUTE_DTYPE
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
  sys.exit(main())
