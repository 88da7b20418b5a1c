"""Benchmarks of the registered schedules: throughput, overhead, dispatch, memory, speed-up.

(`python -m fdg_jax.bench concurrency ...` and `... data ...` are the other two benchmarks.)

    python -m fdg_jax.bench all --out docs/results/bench_cpu.json        # small sizes (CPU default)
    python -m fdg_jax.bench throughput --model resnet56 --batch_size 128 --ticks 50   # GPUs
    python -m fdg_jax.bench memory --presets resnet20 mlp_digits

Commands (each prints a markdown table and writes JSON to --out), one module each:

  throughput  samples/s and step time of each schedule of --algorithms for one model and
              global batch at each K in --stages; stages on K distinct devices when there are
              K, else all on one (`fdg_jax.bench.throughput`).
  overhead    one device only: time per sample of each schedule split into K stages
              (`devices=None`) over BP's unsplit K=1 time per sample, for both backward
              policies (stash, recompute). The price of splitting and stashing, no concurrency
              (`fdg_jax.bench.overhead`).
  dispatch    host time per tick of a tiny model (return from `schedule.step` without
              blocking), divided by K: the per-stage Python + dispatch cost (BP and DDG
              make 2K-1 jitted calls per tick, FDG K) (`fdg_jax.bench.dispatch`).
  memory      bytes held by each stage's delay buffer (`schedule.stash_bytes`) under stash and
              recompute, next to the parameter bytes and backprop's activation bytes
              (`fdg_jax.bench.memory`).
  speedup     predicted speed-up on K devices from per-stage forward/backward times measured
              on one device and measured (or assumed) transfer times, for every registered
              schedule (synchronous and asynchronous ticks; the micro-batched pipelines at
              each M of --microbatches); next to the measured speed-up (throughput at K
              devices over BP at K=1), flagged as not meaningful on forced CPU devices
              (`fdg_jax.bench.speedup`).
  all         all of the above with shared settings, one JSON.

Timing: every timed region ends with `jax.block_until_ready`; compilation is excluded by running
2(K-1)+2 ticks first (past the pipeline fill, where the last per-stage variants compile); each
of --repeats repetitions times --ticks ticks, and the repetitions of the schedules compared in
one table are interleaved (round-robin), so that load from other processes hits them alike;
tables give the median and the [min, max] spread (`fdg_jax.bench.timing`). The input batch is
placed on stage 0's device once, so host-to-device copies are not timed.

On CPU, `--num_cpu_devices` (default 4) forced XLA:CPU devices share the machine's cores, so
timings of several "devices" measure contention, not concurrency (see docs/notes.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

from fdg_jax import plans as plans_lib
from fdg_jax.bench import common
from fdg_jax.bench.common import (DEFAULT_INPUT_SHAPE, DEFAULT_MODEL_KWARGS, POLICIES,
                                  PRESETS, build_model, device_info, every_plan, tick_plans)
from fdg_jax.bench.dispatch import bench_dispatch, dispatch_table
from fdg_jax.bench.memory import bench_memory, memory_table
from fdg_jax.bench.overhead import bench_overhead, overhead_table
from fdg_jax.bench.speedup import bench_speedup, speedup_table
from fdg_jax.bench.throughput import bench_throughput, throughput_table


def parse_args(argv=None):
  pipelines = " and ".join(plans_lib.names(microbatched=True)) or "the micro-batched plans"
  parser = argparse.ArgumentParser(prog="python -m fdg_jax.bench",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("command", choices=("throughput", "overhead", "dispatch", "memory",
                                          "speedup", "all"))
  parser.add_argument("--model", default="mlp")
  parser.add_argument("--model_kwargs", type=json.loads, default=None,
                      help='JSON, e.g. \'{"widths": [512, 512]}\' (default for mlp: 4 x 1024 '
                      'on 1024-dim inputs)')
  parser.add_argument("--input_shape", type=int, nargs="+", default=None,
                      help="input shape for models that take one (mlp, cnn); for the ResNets the "
                      "example image size (any H x W works: global pooling)")
  parser.add_argument("--batch_size", type=int, default=128, help="global batch per tick")
  parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4], help="values of K")
  parser.add_argument("--algorithms", nargs="+", default=list(tick_plans()),
                      choices=every_plan(), help="the schedules of throughput (and speedup's "
                      f"columns); {pipelines} run --sync_microbatches micro-batches")
  parser.add_argument("--sync_microbatches", type=int, default=4,
                      help=f"M of the {pipelines} throughput runs")
  parser.add_argument("--split", default="balanced", help="uniform | balanced | paper")
  parser.add_argument("--backward", default="stash", choices=POLICIES,
                      help="backward policy of the throughput runs")
  parser.add_argument("--ticks", type=int, default=20, help="timed ticks per repetition")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dispatch_ticks", type=int, default=200)
  parser.add_argument("--dispatch_model", default="tiny",
                      help="dispatch benchmark model: tiny (an MLP of width 16) or a model name")
  parser.add_argument("--dispatch_batch", type=int, default=2,
                      help="batch of a named --dispatch_model")
  parser.add_argument("--paths", nargs="+", default=["run", "step"], choices=("run", "step"),
                      help="how overhead and dispatch call the schedule")
  parser.add_argument("--run_ticks", type=int, default=32, help="T of each run call")
  parser.add_argument("--compiler_options", nargs="+", default=["default"],
                      help="overhead: XLA options of the schedules' programs, each variant "
                      "timed side by side: 'default' (the platform's) or JSON, e.g. '{}' "
                      "for XLA's own")
  parser.add_argument("--gates", nargs="+", default=["default"],
                      choices=("default", "mask", "cond"),
                      help="overhead: how the fused engine gates the delayed schedules' stages "
                      "during the pipeline fill (Schedule's gate), each timed side by side")
  parser.add_argument("--pin_host", action="store_true",
                      help="dispatch, on CPU: time with the calling thread alone on one core "
                      "and the runtime's threads on the others (Linux), so that device work "
                      "does not count as host time")
  parser.add_argument("--replicas", type=int, default=1,
                      help="dispatch: R > 1 times the engines on an R x K (data, stage) mesh")
  parser.add_argument("--engines", nargs="+", default=["per_stage", "spmd", "fused"],
                      choices=("per_stage", "spmd", "fused"),
                      help="dispatch: the engines timed (per_stage and spmd on K devices)")
  parser.add_argument("--presets", nargs="+", default=["resnet20", "mlp_digits", "vit"],
                      choices=sorted(PRESETS), help="memory benchmark models")
  parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 16],
                      help=f"M of the {pipelines} predictions (speedup)")
  parser.add_argument("--link_gbps", type=float, default=25.0,
                      help="assumed link bandwidth (GB/s) when only one device is present")
  parser.add_argument("--link_latency_us", type=float, default=10.0)
  parser.add_argument("--num_cpu_devices", type=int, default=4,
                      help="XLA:CPU devices to force (ignored on GPU/TPU)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="compute dtype of the stages (float32 master weights)")
  parser.add_argument("--out", default=None,
                      help="JSON file (default bench_<command>_<platform>.json)")
  args = parser.parse_args(argv)
  if args.model_kwargs is None:
    args.model_kwargs = DEFAULT_MODEL_KWARGS.get(args.model, {})
    if args.input_shape is None:
      args.input_shape = DEFAULT_INPUT_SHAPE.get(args.model)
  return args


def run(args) -> dict:
  """Runs `args.command`; returns the JSON-ready result (also written to args.out)."""
  # Must precede JAX's backend start; harmless on GPUs (it only concerns XLA:CPU).
  with contextlib.suppress(Exception):
    import jax
    jax.config.update("jax_num_cpu_devices", int(args.num_cpu_devices))
  info = device_info()
  common.COMPUTE_DTYPE = args.dtype
  model = build_model(args.model, args.model_kwargs, args.input_shape)
  result: dict[str, Any] = {
      "meta": {**info, "command": args.command, "model": model.name,
               "model_kwargs": args.model_kwargs, "input_shape": list(model.input_shape),
               "batch_size": args.batch_size, "stages": args.stages, "split": args.split,
               "dtype": args.dtype,
               "ticks": args.ticks, "repeats": args.repeats,
               "time": time.strftime("%Y-%m-%d %H:%M:%S")}}
  tables = []
  cmd = args.command
  if cmd in ("throughput", "all", "speedup"):
    result["throughput"] = bench_throughput(args, model)
    tables.append(("Throughput", throughput_table(result["throughput"])))
  if cmd in ("speedup", "all"):
    result["speedup"] = bench_speedup(args, model, result["throughput"])
    tables.append(("Predicted and measured speed-up over BP K=1", speedup_table(
        result["speedup"], args.algorithms)))
  if cmd in ("overhead", "all"):
    result["overhead"] = bench_overhead(args, model)
    tables.append(("Per-sample overhead on one device", overhead_table(result["overhead"])))
  if cmd in ("dispatch", "all"):
    result["dispatch"] = bench_dispatch(args)
    tables.append(("Dispatch overhead", dispatch_table(result["dispatch"])))
  if cmd in ("memory", "all"):
    result["memory"] = bench_memory(args)
    tables.append(("Delay-buffer memory", memory_table(result["memory"])))
  if hasattr(os, "getloadavg"):
    result["meta"]["load_average_end"] = list(os.getloadavg())
  out = args.out or f"bench_{cmd}_{info['platform']}.json"
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  m = result["meta"]
  print(f"{m['platform']} x{m['num_devices']} ({m['device_kind']}), model {m['model']} "
        f"{m['model_kwargs'] or ''} input {tuple(m['input_shape'])}, batch {m['batch_size']}; "
        f"load average {m['load_average']} -> {m.get('load_average_end')}")
  for title, table in tables:
    print(f"\n### {title}\n\n{table}")
  print(f"\nwrote {out}")
  return result


def main(argv=None) -> int:
  run(parse_args(argv))
  return 0


if __name__ == "__main__":
  sys.exit(main())
