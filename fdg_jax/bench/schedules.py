"""Benchmarks of the BP, DDG and FDG schedules: throughput, overhead, dispatch, memory, speed-up.

(`python -m fdg_jax.bench concurrency ...` and `... data ...` are the other two benchmarks.)

    python -m fdg_jax.bench all --out docs/results/bench_cpu.json        # small sizes (CPU default)
    python -m fdg_jax.bench throughput --model resnet56 --batch_size 128 --ticks 50   # GPUs
    python -m fdg_jax.bench memory --presets resnet20 mlp_digits

Commands (each prints a markdown table and writes JSON to --out):

  throughput  samples/s and step time of BP, DDG, FDG for one model and global batch at each K
              in --stages; stages on K distinct devices when there are K, else all on one.
  overhead    one device only: time per sample of each schedule split into K stages
              (`devices=None`) over BP's unsplit K=1 time per sample, for both backward
              policies (stash, recompute). The price of splitting and stashing, no concurrency.
  dispatch    host time per tick of a tiny model (return from `schedule.step` without
              blocking), divided by K: the per-stage Python + dispatch cost (BP and DDG
              make 2K-1 jitted calls per tick, FDG K).
  memory      bytes held by each stage's delay buffer (`schedule.stash_bytes`) under stash and
              recompute, next to the parameter bytes and backprop's activation bytes.
  speedup     predicted speed-up on K devices from per-stage forward/backward times measured
              on one device and measured (or assumed) transfer times, for FDG and DDG
              (synchronous and asynchronous ticks) and a GPipe-style pipeline; next to the
              measured speed-up (throughput at K devices over BP at K=1), flagged as not
              meaningful on forced CPU devices.
  all         all of the above with shared settings, one JSON.

Timing: every timed region ends with `jax.block_until_ready`; compilation is excluded by running
2(K-1)+2 ticks first (past the pipeline fill, where the last per-stage variants compile); each
of --repeats repetitions times --ticks ticks, and the repetitions of the schedules compared in
one table are interleaved (round-robin), so that load from other processes hits them alike;
tables give the median and the [min, max] spread. The input batch is placed on stage 0's
device once, so host-to-device copies are not timed.

On CPU, `--num_cpu_devices` (default 4) forced XLA:CPU devices share the machine's cores, so
timings of several "devices" measure contention, not concurrency (see docs/notes.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Callable, Sequence

from fdg_jax import plans as plans_lib

ALGORITHMS = plans_lib.names(microbatched=False)  # the tick plans: the default of --algorithms
SYNC = plans_lib.names(microbatched=True)  # the synchronous pipelines
PLANS = ALGORITHMS + SYNC  # every schedule `throughput` can run (as registered at import)
POLICIES = ("stash", "recompute")

# Memory presets: (model, model kwargs, input shape or None for the model's, batch size).
PRESETS = {
    "resnet20": ("resnet20", {}, None, 128),       # CIFAR-sized input
    "resnet56": ("resnet56", {}, None, 128),
    "mlp_digits": ("mlp", {"widths": (128, 128, 128, 128)}, (8, 8, 1), 32),  # the quick start
    "mlp_bench": ("mlp", {"widths": (1024, 1024, 1024, 1024)}, (1024,), 128),  # the default
    "vit": ("vit", {}, None, 32),                   # CIFAR-sized ViT (LayerNorm)
}
# The default benchmark model: four equal 1024-wide dense blocks (and a small head) on
# 1024-dim inputs, so that a balanced split into 2 or 4 stages is exact and the speed-up
# model is not limited by one heavy block. Small enough for CPU; use --model on GPUs.
DEFAULT_MODEL_KWARGS = {"mlp": {"widths": [1024, 1024, 1024, 1024]}}
DEFAULT_INPUT_SHAPE = {"mlp": [1024]}
TINY = ("mlp", {"widths": (16, 16, 16, 16)}, (8, 8, 1), 8)  # the dispatch benchmark's model


# ------------------------------------------------------------------------------ helpers
def _jax():
  import jax
  return jax


def spread(values: Sequence[float]) -> dict:
  """median, min, max and relative spread (max - min) / median of repeated measurements."""
  med = statistics.median(values)
  return {"median": med, "min": min(values), "max": max(values),
          "rel_spread": (max(values) - min(values)) / med if med > 0 else 0.0,
          "values": list(values)}


def block(tree) -> None:
  """Waits for every device array in `tree` (host values are skipped)."""
  jax = _jax()
  for leaf in jax.tree.leaves(tree):
    if hasattr(leaf, "block_until_ready"):
      leaf.block_until_ready()


def build_model(model_name: str, model_kwargs: dict, input_shape=None):
  """The registered model, with `input_shape` passed to models that take one (mlp, cnn).

  A model that takes none (the ResNets: convolutions and a global pooling, so any image size
  works) gets `input_shape` as its example shape instead, e.g. ResNet-110 at 8x8: the same
  programs and leaves as at 32x32, with a sixteenth of the compute, for dispatch timings on
  CPU devices that share the host's cores.
  """
  import dataclasses
  from fdg_jax import models
  kwargs = dict(model_kwargs or {})
  if input_shape is None:
    return models.create(model_name, num_classes=10, **kwargs)
  shape = tuple(int(s) for s in input_shape)
  try:
    return models.create(model_name, num_classes=10, input_shape=shape, **kwargs)
  except ValueError as e:
    if "input_shape" not in str(e):
      raise
  model = models.create(model_name, num_classes=10, **kwargs)
  if len(shape) != len(model.input_shape) or shape[-1] != model.input_shape[-1]:
    raise ValueError(f"--input_shape {shape} for {model_name}: give (H, W, "
                     f"{model.input_shape[-1]}), like its own {model.input_shape}")
  return dataclasses.replace(model, input_shape=shape)


def build_stages(model, num_stages: int, split, batch_size: int):
  """Stages, params and model states of `model` split into `num_stages` (`split` as in
  `partition.boundaries`)."""
  import jax.numpy as jnp
  import fdg_jax
  from fdg_jax import partition
  x = model.example_input(batch_size)
  bounds = partition.boundaries(model, num_stages, split, example_input=x) \
      if num_stages > 1 else []
  stages = partition.stages_from_boundaries(model, bounds)
  x1 = jnp.zeros((1,) + tuple(model.input_shape), jnp.float32)
  params, states = fdg_jax.init_stages(stages, _jax().random.PRNGKey(0), x1)
  from fdg_jax import precision
  stages = [precision.mixed_precision(s, precision.DTYPES[COMPUTE_DTYPE]) for s in stages]
  return bounds, stages, params, states


# --dtype: the stages compute in it (float32 master weights; `fdg_jax.precision`).
COMPUTE_DTYPE = "float32"


def loss_fn(logits, labels):
  """The trainer's loss, in float32 (imported lazily: this module keeps its CLI start-up
  light)."""
  from fdg_jax.trainer import loss_fn as trainer_loss
  return trainer_loss(logits.astype("float32"), labels)


def optimizer():
  """SGD with momentum: the papers' optimiser (its update cost is part of a tick)."""
  import optax
  return optax.sgd(0.01, momentum=0.9)


def random_batch(model, batch_size: int, device=None):
  jax = _jax()
  kx, ky = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(kx, (batch_size,) + tuple(model.input_shape), jax.numpy.float32)
  y = jax.random.randint(ky, (batch_size,), 0, model.num_classes, jax.numpy.int32)
  if device is not None:
    x, y = jax.device_put((x, y), device)
  return x, y


def placement_for(num_stages: int):
  """(devices argument, label): K distinct devices when there are K, else one."""
  devs = _jax().devices()
  if num_stages > 1 and len(devs) >= num_stages:
    return devs[:num_stages], f"{num_stages} devices"
  return None, "1 device"


def mesh_for(num_replicas: int, num_stages: int):
  """An R x K (data, stage) mesh of this process's devices, or None where there are too
  few."""
  from fdg_jax.placement import make_mesh
  if len(_jax().devices()) < num_replicas * num_stages or num_stages < 2:
    return None
  return make_mesh(num_replicas, num_stages)


def _first_place(where: dict):
  """Where stage 0's batch lives: its device, its column of the mesh (split along the
  batch), or the default device."""
  if where.get("devices"):
    return where["devices"][0]
  if where.get("mesh") is not None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    column = Mesh(where["mesh"].devices[:, 0], ("data",))
    return NamedSharding(column, PartitionSpec("data"))
  return None


def make_schedule(algorithm, stages, *, backward="stash", devices=None, engine="auto",
                  compiler_options=None, mesh=None, gate=None, microbatches: int = 4):
  import fdg_jax
  if algorithm in SYNC:
    return fdg_jax.create(algorithm, stages, loss_fn, optimizer(), devices=devices,
                          engine=engine, microbatches=microbatches)
  kwargs = {"devices": devices, "engine": engine, "compiler_options": compiler_options,
            "mesh": mesh, "gate": gate}
  if "backward" in plans_lib.spec(algorithm).options:
    kwargs["backward"] = backward
  return fdg_jax.create(algorithm, stages, loss_fn, optimizer(), **kwargs)


def _with_backward(algorithms) -> list[str]:
  """Those of `algorithms` whose backward policy matters: the delayed tick plans (BP's one
  slot is read within its tick)."""
  return [a for a in algorithms if plans_lib.spec(a).delayed
          and not plans_lib.spec(a).microbatched and "backward" in plans_lib.spec(a).options]


def prepare(schedule, params, states, batch, warmup: int | None = None,
            run_ticks: int | None = None) -> dict:
  """A schedule in its steady state, ready for `time_interleaved`.

  Runs `warmup` ticks (default 2(K-1)+2: past the pipeline fill, where the last per-stage
  variants compile) and blocks. With `run_ticks` = T the schedule is timed through
  `schedule.run` on T stacked copies of `batch` (placed once, like the batch), else through
  `schedule.step`.
  """
  jax = _jax()
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


def write_figures(figures: dict, path: str | None) -> dict:
  """`figures` as indented JSON to `path` (if one is given); returns them."""
  if path:
    with open(path, "w") as f:
      json.dump(figures, f, indent=1)
  return figures


def device_info() -> dict:
  jax = _jax()
  devs = jax.devices()
  return {"platform": devs[0].platform, "device_kind": devs[0].device_kind,
          "num_devices": len(devs), "devices": [str(d) for d in devs],
          "jax": jax.__version__, "host": platform.node(), "cpu_count": os.cpu_count(),
          # Other processes' load: timings on a shared machine are only as good as this.
          "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
          # XLA:CPU sizes its runtime's thread pools from NPROC when set (else the cores).
          "NPROC": os.environ.get("NPROC")}


# ------------------------------------------------------------------------------ throughput
def bench_throughput(args, model) -> list[dict]:
  """samples/s and step time of every algorithm at every K, same model and global batch."""
  rows, entries = [], []
  for K in args.stages:
    bounds, stages, params, states = build_stages(model, K, args.split, args.batch_size)
    devices, where = placement_for(K)
    batch = random_batch(model, args.batch_size, devices[0] if devices else None)
    for algorithm in args.algorithms:
      M = args.sync_microbatches if algorithm in SYNC else None
      if M is not None and args.batch_size % M:
        raise ValueError(f"--batch_size {args.batch_size} is not a multiple of "
                         f"--sync_microbatches {M}")
      schedule = make_schedule(algorithm, stages, backward=args.backward, devices=devices,
                               microbatches=M or 1)
      entries.append(prepare(schedule, params, states, batch))
      rows.append({
          "algorithm": algorithm, "num_stages": K, "boundaries": bounds, "placement": where,
          "backward": (args.backward if "backward" in plans_lib.spec(algorithm).options
                       else None),
          "microbatches": M, "host_calls_per_tick": host_calls_per_tick(schedule),
          "peak_stash": list(schedule.ring_sizes),
          "batch_size": args.batch_size, "ticks": args.ticks, "repeats": args.repeats})
  times = time_interleaved(entries, ticks=args.ticks, repeats=args.repeats)
  for row, t in zip(rows, times):
    row.update(step_time_s=spread(t["step"]), host_time_s=spread(t["host"]),
               samples_per_s=spread([args.batch_size / x for x in t["step"]]),
               loss_finite=t["loss_finite"])
    _progress(f"throughput {row['algorithm']} K={row['num_stages']} ({row['placement']}): "
              f"{row['samples_per_s']['median']:.0f} samples/s")
  del entries
  return rows


def host_calls_per_tick(schedule) -> int:
  """Jitted calls the per-stage engine makes per steady tick: one per call of the plan
  (BP and DDG 2K-1, FDG K); a synchronous pipeline's M forwards and M-per-stage backwards
  (K M + (K-1) M) and one update per stage."""
  plan = getattr(schedule, "plan", None)
  if plan is not None:
    return len(plan.calls)
  K, M = schedule.num_stages, schedule.microbatches
  return K * M + (K - 1) * M + K


def throughput_table(rows) -> str:
  lines = ["| schedule | K | placement | step time ms, median [min, max] | samples/s median | "
           "host calls per tick | peak stash per stage (slots; micro-batches for GPipe/1F1B) |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    s = r["step_time_s"]
    name = r["algorithm"].upper() + (f" M={r['microbatches']}" if r.get("microbatches") else "")
    lines.append(f"| {name} | {r['num_stages']} | {r['placement']} | "
                 f"{1e3 * s['median']:.2f} [{1e3 * s['min']:.2f}, {1e3 * s['max']:.2f}] | "
                 f"{r['samples_per_s']['median']:,.0f} | {r.get('host_calls_per_tick', '–')} | "
                 f"{', '.join(map(str, r.get('peak_stash', []))) or '–'} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ overhead
def _paths(args) -> list[tuple[str, int | None]]:
  """(label, T) of the calls timed: `step` (T None) and/or `run` of T ticks per call."""
  return [("step", None) if p == "step" else (f"run T={args.run_ticks}", args.run_ticks)
          for p in args.paths]


def _compiler_options(args) -> list[tuple[str, dict | None]]:
  """(label, Schedule's compiler_options) of each --compiler_options value."""
  return [(v, None) if v == "default" else (v, json.loads(v)) for v in args.compiler_options]


def bench_overhead(args, model) -> list[dict]:
  """Per-sample time on ONE device of each schedule split into K stages over BP K=1's.

  Each call path (`step`, `run`) is compared with BP K=1 through the same path. The ratio
  is taken per repetition against BP K=1's interleaved repetition, then the median.
  """
  dev = _jax().devices()[0]
  batch = random_batch(model, args.batch_size, dev)
  _, stages1, params1, states1 = build_stages(model, 1, args.split, args.batch_size)
  Ks = [k for k in args.stages if k > 1]
  split = {K: build_stages(model, K, args.split, args.batch_size) for K in Ks}
  rows, entries, bases = [], [], []
  for (path, T), (label, options), gate in itertools.product(
      _paths(args), _compiler_options(args), args.gates):
    base = len(entries)
    common = {"path": path, "compiler_options": label}
    rows.append({"algorithm": "bp", "num_stages": 1, "backward": None, **common})
    entries.append(prepare(make_schedule("bp", stages1, compiler_options=options), params1,
                           states1, batch, run_ticks=T))
    bases.append(base)
    for K in Ks:
      _, stages, params, states = split[K]
      variants = [("bp", None)] + [(a, p) for a in _with_backward(args.algorithms)
                                   for p in POLICIES]
      for algorithm, policy in variants:
        schedule = make_schedule(algorithm, stages, backward=policy or "stash", devices=None,
                                 compiler_options=options,
                                 gate=None if gate == "default" else gate)
        entries.append(prepare(schedule, params, states, batch, run_ticks=T))
        # BP has no traced flags: nothing to gate
        rows.append({"algorithm": algorithm, "num_stages": K, "backward": policy, **common,
                     "gate": schedule.gate if algorithm != "bp" else "–"})
        bases.append(base)
  times = time_interleaved(entries, ticks=args.ticks, repeats=args.repeats)
  for row, t, base in zip(rows, times, bases):
    b = times[base]["step"]
    ratios = [x / y for x, y in zip(t["step"], b)]
    row.update(time_per_sample_s=spread([x / args.batch_size for x in t["step"]]),
               ratio_vs_bp=statistics.median(ratios), ratio_vs_bp_spread=spread(ratios),
               # Fastest over fastest: the least disturbed repetitions of a shared machine.
               ratio_of_minima=min(t["step"]) / min(b))
    _progress(f"overhead {row['path']} {row['compiler_options']} {row.get('gate', '')} "
              f"{row['algorithm']} "
              f"K={row['num_stages']} "
              f"{row['backward'] or ''}: x{row['ratio_vs_bp']:.3f}")
  del entries
  return rows


def overhead_table(rows) -> str:
  # The compiler-options column only where rows differ in it; the gate where one is set.
  options = len({r.get("compiler_options", "default") for r in rows}) > 1
  gates = any("gate" in r for r in rows)
  lines = ["| path | " + ("compiler options | " if options else "") +
           ("gate | " if gates else "") +
           "algorithm | K | backward | µs per sample, median [min, max] | "
           "× BP K=1 (same path), median [min, max] | × BP K=1, min / min |",
           "|---|---|---|---|---|---|---|" + ("---|" if options else "") +
           ("---|" if gates else "")]
  for r in rows:
    s, q = r["time_per_sample_s"], r["ratio_vs_bp_spread"]
    col = f" {r.get('compiler_options', 'default')} |" if options else ""
    col += f" {r.get('gate', '–')} |" if gates else ""
    lines.append(f"| {r.get('path', 'step')} |{col} {r['algorithm'].upper()} | "
                 f"{r['num_stages']} | "
                 f"{r['backward'] or '–'} | "
                 f"{1e6 * s['median']:.2f} [{1e6 * s['min']:.2f}, {1e6 * s['max']:.2f}] | "
                 f"{r['ratio_vs_bp']:.3f} [{q['min']:.3f}, {q['max']:.3f}] | "
                 f"{r['ratio_of_minima']:.3f} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ dispatch
def bench_dispatch(args) -> list[dict]:
  """Host time per tick (no blocking) of a tiny model, and per stage (÷ K).

  Each (algorithm, K) is timed through `step` and `run` (--paths), on K devices (the
  per-stage engine: a jitted call per stage, 2K-1 per tick for BP and DDG, K for FDG, plus
  the moves of the messages; for FDG also the SPMD engine: one program over the K devices
  per call, `step` being `run` with T = 1) and on one device (the fused engine: one
  program per call). With fewer than K devices (one GPU), the per-stage engine runs its K
  calls per tick on the one device instead, with no messages to move. With --replicas
  R > 1, on an R x K (data, stage) mesh instead: the per-stage engine (its calls span a
  stage's R devices) and the SPMD engine (one program over the R x K devices); the batch is
  the global one, R times --dispatch_batch.
  """
  if args.dispatch_model == "tiny":
    name, kwargs, shape, batch_size = TINY
    split = "uniform"
  else:
    name, kwargs, shape, batch_size = args.dispatch_model, {}, None, args.dispatch_batch
    if name == args.model:  # --model_kwargs and --input_shape apply to it
      kwargs, shape = args.model_kwargs, args.input_shape
    split = args.split
  model = build_model(name, kwargs, shape)
  R = args.replicas
  batch_size *= R
  rows, entries = [], []
  for K in args.stages:
    _, stages, params, states = build_stages(model, K, split, batch_size)
    if R > 1:
      mesh = mesh_for(R, K)
      places = [({"mesh": mesh}, f"{R}x{K} mesh", e) for e in ("per_stage", "spmd") if mesh]
    else:
      devices, where = placement_for(K)
      places = [({"devices": devices}, where, e) for e in ("per_stage", "spmd") if devices]
      if not devices and K > 1:
        # Fewer devices than stages (one GPU): the per-stage engine's K calls per tick on
        # the one device, so that its host cost is measured there too (no message moves).
        places.append(({"devices": [_jax().devices()[0]] * K}, f"{K} stages on 1 device",
                       "per_stage"))
      places.append(({}, "1 device", "fused"))
    places = [p for p in places if p[2] in args.engines]
    for path, T in _paths(args):
      for where, label, engine in places:
        batch = random_batch(model, batch_size, _first_place(where))
        for algorithm in args.algorithms:
          spec = plans_lib.spec(algorithm)
          if engine not in spec.engines or spec.microbatched:
            continue  # an engine it does not run on; GPipe and 1F1B: throughput only
          schedule = make_schedule(algorithm, stages, engine=engine, **where)
          entries.append(prepare(schedule, params, states, batch, run_ticks=T))
          rows.append({"algorithm": algorithm, "num_stages": K, "placement": label,
                       "replicas": R, "engine": engine, "path": path,
                       "ticks": args.dispatch_ticks,
                       "model": model.name, "batch_size": batch_size,
                       "warmup_s": entries[-1]["warmup_s"],
                       "leaves_per_stage": [len(jax_leaves(s)) for s in
                                            entries[-1]["state"]["stages"]]})
  with host_thread_pinned(args.pin_host):
    times = time_interleaved(entries, ticks=args.dispatch_ticks, repeats=args.repeats)
  for row, t in zip(rows, times):
    K = row["num_stages"]
    row["host_pinned"] = bool(args.pin_host)
    row.update(host_time_per_tick_s=spread(t["host"]),
               host_time_per_stage_tick_s=spread([h / K for h in t["host"]]),
               idle_host_time_per_stage_tick_s=spread([h / K for h in t["host_idle"]]),
               host_cpu_time_per_stage_tick_s=spread([h / K for h in t["host_cpu"]]),
               step_time_s=spread(t["step"]))
    _progress(f"dispatch {row['path']} {row['engine']} {row['algorithm']} K={K}: "
              f"{1e6 * row['host_time_per_stage_tick_s']['median']:.0f} µs/stage-tick")
  del entries
  return rows


def dispatch_table(rows) -> str:
  lines = ["| algorithm | K | path | placement (engine) | host µs per tick | host µs per stage "
           "per tick, median [min, max] | same, devices idle | host thread's CPU µs per "
           "stage per tick | blocked µs per tick | first call / warm-up s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    h, p = r["host_time_per_tick_s"], r["host_time_per_stage_tick_s"]
    idle = r.get("idle_host_time_per_stage_tick_s", {"median": float("nan")})
    cpu = r.get("host_cpu_time_per_stage_tick_s", {"median": float("nan")})
    lines.append(f"| {r['algorithm'].upper()} | {r['num_stages']} | {r.get('path', 'step')} | "
                 f"{r['placement']} ({r.get('engine', 'per_stage')}) | "
                 f"{1e6 * h['median']:.0f} | {1e6 * p['median']:.0f} [{1e6 * p['min']:.0f}, "
                 f"{1e6 * p['max']:.0f}] | {1e6 * idle['median']:.0f} | "
                 f"{1e6 * cpu['median']:.0f} | "
                 f"{1e6 * r['step_time_s']['median']:.0f} | "
                 f"{r.get('warmup_s', float('nan')):.1f} |")
  if rows and "model" in rows[0]:
    r = rows[0]
    lines += ["", f"model {r['model']}, batch {r['batch_size']}; packed state buffers per stage "
              f"(K={r['num_stages']}): {r['leaves_per_stage']}"]
    if r.get("host_pinned"):
      lines.append("host thread pinned to its own core (--pin_host)")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ memory
def jax_leaves(tree) -> list:
  return _jax().tree.leaves(tree)


def tree_bytes(tree) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in _jax().tree.leaves(tree)))


def bench_memory(args) -> list[dict]:
  """Delay-buffer bytes per stage against parameter and activation bytes, per preset."""
  from fdg_jax import partition
  rows = []
  for preset in args.presets:
    name, kwargs, shape, batch_size = PRESETS[preset]
    model = build_model(name, kwargs, shape)
    x = model.example_input(batch_size)
    # Backprop's activation memory: the vjp residuals of the unsplit model for one batch.
    whole = partition.stages_from_boundaries(model, [])[0]
    bp_activation = partition.residual_bytes(whole, x)
    infos = partition.block_info(model, x)
    for K in [k for k in args.stages if k > 1]:
      bounds, stages, params, states = build_stages(model, K, args.split, batch_size)
      param_bytes = [tree_bytes(p) for p in params]
      # What crosses each boundary (one activation message; the cotangent is the same size).
      boundary = [int(infos[b - 1].output.size * infos[b - 1].output.dtype.itemsize)
                  for b in bounds]
      batch = (_jax().numpy.zeros(x.shape, x.dtype),
               _jax().numpy.zeros((batch_size,), _jax().numpy.int32))
      for algorithm in _with_backward(ALGORITHMS):
        for policy in POLICIES:
          schedule = make_schedule(algorithm, stages, backward=policy, devices=None)
          state = schedule.init(params, states, example_batch=batch)
          stash = schedule.stash_bytes(state)
          del state
          total = sum(stash)
          # With the rings' heads (the default off CPU): one more slot where D >= 2. A
          # stage's bytes are D slots and D int32 batch indices.
          heads = total if schedule.ring_heads else total + sum(
              (b - 4 * D) // D for b, D in zip(stash, schedule.ring_sizes) if D > 1)
          rows.append({
              "preset": preset, "model": model.name, "batch_size": batch_size,
              "input_shape": list(model.input_shape), "num_stages": K, "boundaries": bounds,
              "algorithm": algorithm, "backward": policy, "ring_sizes": schedule.ring_sizes,
              "ring_heads": schedule.ring_heads, "stash_bytes": stash,
              "stash_bytes_total": total, "stash_bytes_total_with_heads": heads,
              "param_bytes": param_bytes, "param_bytes_total": sum(param_bytes),
              "bp_activation_bytes": bp_activation, "boundary_activation_bytes": boundary,
              "stash_over_params": total / max(sum(param_bytes), 1),
              "stash_over_bp_activations": total / max(bp_activation, 1),
          })
          _progress(f"memory {preset} {algorithm} K={K} {policy}: {_mib(total)}")
  return rows


def _mib(n: float) -> str:
  return f"{n / 2**20:.2f} MiB"


def memory_table(rows) -> str:
  lines = ["| model (batch) | K | schedule | backward | stash per stage (MiB) | total MiB | "
           "× params | × BP activations | total MiB with ring heads |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    per = ", ".join(f"{b / 2**20:.2f}" for b in r["stash_bytes"])
    lines.append(f"| {r['model']} ({r['batch_size']}) | {r['num_stages']} | "
                 f"{r['algorithm'].upper()} | {r['backward']} | {per} | "
                 f"{r['stash_bytes_total'] / 2**20:.2f} | {r['stash_over_params']:.1f} | "
                 f"{r['stash_over_bp_activations']:.2f} | "
                 f"{r['stash_bytes_total_with_heads'] / 2**20:.2f} |")
  seen = {}
  for r in rows:
    seen.setdefault((r["model"], r["batch_size"]), r)
  notes = [f"{m} (batch {b}): parameters {_mib(r['param_bytes_total'])}, backprop "
           f"activations (vjp residuals of one batch) {_mib(r['bp_activation_bytes'])}"
           for (m, b), r in seen.items()]
  return "\n".join(lines + [""] + notes)


# ------------------------------------------------------------------------------ speed-up model
def _time_fn(fn: Callable, args: tuple, *, calls: int, repeats: int,
             warm: bool = True) -> list[float]:
  """Seconds per call of jitted `fn(*args)`, `repeats` x `calls` calls (after two untimed
  calls that compile it, unless `warm` is False)."""
  if warm:
    block(fn(*args))
    block(fn(*args))
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      r = fn(*args)
    block(r)
    out.append((time.perf_counter() - t0) / calls)
  return out


def stage_times(stages, params, states, batch, *, calls: int, repeats: int, device=None):
  """Per-stage training forward time f_k and tick time w_k on one device, batch-sized inputs;
  b_k = w_k - f_k. Also the bytes of the activation each stage sends.

  w_k is the forward, the vjp against a cotangent (the loss gradient for the last stage) and
  the SGD-momentum update in one call: an FDG stage tick without the stash ring write (a copy
  of the residuals, small next to the compute); DDG runs the same work as two calls, a
  forward f_k and a backward b_k. The input cotangent is computed for stages k > 0
  only, as in the schedules. The repetitions of all stages are interleaved.
  """
  jax = _jax()
  opt = optimizer()
  x, y = batch
  rng = jax.random.PRNGKey(0)
  K = len(stages)
  jobs = []
  for k, stage in enumerate(stages):
    p, ms = jax.device_put((params[k], states[k]), device)
    o = opt.init(p)
    argnums = (0, 1) if k > 0 else (0,)

    def fwd(p, ms, a, stage=stage):
      return stage.apply(p, ms, a, train=True, rng=rng)

    def tick(p, o, ms, a, cot, stage=stage, last=k == K - 1, argnums=argnums):
      def objective(p, a):
        out, new_ms = stage.apply(p, ms, a, train=True, rng=rng)
        # Other stages: <cotangent, output>, the cotangent an argument so that XLA cannot
        # simplify the backward around a constant.
        return (loss_fn(out, y) if last else jax.numpy.vdot(cot, out)), new_ms
      (_, new_ms), grads = jax.value_and_grad(objective, argnums, has_aux=True)(p, a)
      u, o = opt.update(grads[0], o, p)
      return grads[1:], jax.tree.map(lambda a, b: a + b, p, u), o, new_ms

    fwd_j, tick_j = jax.jit(fwd), jax.jit(tick)
    h = fwd_j(p, ms, x)[0]
    cot = jax.random.normal(jax.random.PRNGKey(k), h.shape, h.dtype) if k < K - 1 else None
    jobs.append((fwd_j, (p, ms, x), tick_j, (p, o, ms, x, cot)))
    block(fwd_j(p, ms, x))
    block(tick_j(p, o, ms, x, cot))
    x = h
  f = [[] for _ in stages]
  w = [[] for _ in stages]
  for _ in range(repeats):
    for k, (fwd_j, fargs, tick_j, targs) in enumerate(jobs):
      f[k] += _time_fn(fwd_j, fargs, calls=calls, repeats=1, warm=False)
      w[k] += _time_fn(tick_j, targs, calls=calls, repeats=1, warm=False)
  out = []
  for k, (fwd_j, fargs, _, _) in enumerate(jobs):
    h = fwd_j(*fargs)[0]
    fk, wk = statistics.median(f[k]), statistics.median(w[k])
    out.append({"forward_s": fk, "tick_s": wk, "backward_s": max(wk - fk, 0.0),
                "out_bytes": int(h.size * h.dtype.itemsize)})
  return out


def transfer_time(nbytes: int, *, calls: int, repeats: int, link_gbps: float,
                  link_latency_us: float) -> tuple[float, str]:
  """Seconds to move `nbytes` between two devices: measured between devices 0 and 1 when the
  process has two, else latency + bytes / bandwidth (an assumption, labelled as such)."""
  jax = _jax()
  devs = jax.devices()
  if len(devs) < 2:
    return link_latency_us * 1e-6 + nbytes / (link_gbps * 1e9), "assumed"
  a = jax.device_put(jax.numpy.zeros((max(nbytes // 4, 1),), jax.numpy.float32), devs[0])
  block(a)
  put = lambda: jax.device_put(a, devs[1])
  block(put())
  runs = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      b = put()
      b.block_until_ready()
    runs.append((time.perf_counter() - t0) / calls)
  return statistics.median(runs), f"measured {devs[0].platform} device 0 -> 1"


def predict(times: Sequence[dict], transfers: Sequence[float],
            microbatches: Sequence[int] = (4, 16), host_s: dict | None = None,
            allreduce_s: float | None = None) -> dict:
  """Tick times (seconds) of every registered plan on K devices, and speed-ups over BP.

  Args:
    times: per stage k, {"forward_s": f_k, "backward_s": b_k, "tick_s": w_k = f_k + b_k}
      measured on one device (the last stage's w includes the loss).
    transfers: c_k, seconds to send stage k's output (or the same-sized cotangent) across
      boundary k, k = 0..K-2.
    microbatches: M values for the plans that split the batch (GPipe, 1F1B, ...).
    host_s: {name: h}, seconds for `step` to return (measured for the per-stage engine on
      K devices): an asynchronous tick cannot be shorter than the host's dispatch of one.
    allreduce_s: seconds to all-reduce the whole model's gradients over K devices (ring:
      2(K-1) transfers of 1/K of the parameter bytes); with it, data parallelism is modelled.

  Every plan's tick comes from its calls (`fdg_jax.cost.tick_time`: each call's compute on
  its stage's device, each message's transfer, a device running its calls one at a time in
  the plan's order), so a user's registered plan gets a prediction too:

  - "bp": backpropagation on one device, T = sum_k w_k, the baseline of every speed-up;
  - NAME (each registered plan that does not split the batch, BP's plan on K devices
    included): synchronous ticks, every tick ending before the next starts (as if the host
    blocked on it); NAME_async: ticks overlapping as far as their data allow (what `step`
    does: it returns without waiting), the host's dispatch taken as hidden unless `host_s`
    gives it (then max(T, h), flagged `host_bound` where h > T: the devices wait for the
    host; the remedies: `run` on the fused engine, or for FDG on K devices the SPMD
    engine, one call per T ticks);
  - NAME_M (each plan that splits the batch, for each M): synchronous ticks with
    per-micro-batch times f_k/M, b_k/M, c_k/M (linear scaling: optimistic for small
    micro-batches); `bubble` is the devices' idle share of the tick, 1 - sum_k w_k / (K T);
  - "dp": data parallelism over the same K devices: each runs the whole model on B/K
    (linear scaling), then the gradients are all-reduced, not overlapped:
    T = sum_k w_k / K + allreduce_s.

  The models assume full-duplex links, a transfer not overlapped with the compute of the same
  stage, and a stage's time unchanged when it runs beside others. For BP, DDG and FDG the
  plan-derived ticks equal the closed forms of ALGORITHMS.md's tick orders (tested): DDG
  synchronous max_k of a_k + f_k + b_k + c_{k-1} with a_k = sum_{j<k} (f_j + c_j); FDG
  asynchronous max(max_k w_k, max_k (w_k + w_{k+1} + 2 c_k) / 2); DDG asynchronous the
  heaviest cycle max_{j<=m} (sum_{i=j..m} w_i + 2 sum_{i=j..m-1} c_i) / (m - j + 1).
  """
  from fdg_jax import cost
  K = len(times)
  f = [t["forward_s"] for t in times]
  b = [t["backward_s"] for t in times]
  w = [t["tick_s"] for t in times]
  t_bp = sum(w)
  out = {"bp": {"tick_s": t_bp, "speedup": 1.0}}
  for name in plans_lib.names(microbatched=False):
    try:
      plan = plans_lib.plan(name, K)
    except (ValueError, TypeError, IndexError):  # a user's plan not defined for this K
      continue
    key = name if name != "bp" else "bp_on_devices"
    t = cost.tick_time(plan, f, b, transfers, synchronous=True)
    out[key] = {"tick_s": t, "speedup": t_bp / t}
    t = cost.tick_time(plan, f, b, transfers, synchronous=False)
    out[f"{key}_async"] = {"tick_s": t, "speedup": t_bp / t}
    h = (host_s or {}).get(name)
    if h is not None:
      out[f"{key}_async"].update(tick_s=max(t, h), speedup=t_bp / max(t, h), compute_tick_s=t,
                                 host_s=h, host_bound=h > t)
  for name in plans_lib.names(microbatched=True):
    for M in microbatches:
      t = cost.tick_time(plans_lib.plan(name, K, microbatches=M), f, b, transfers)
      out[f"{name}_{M}"] = {"tick_s": t, "speedup": t_bp / t, "bubble": 1 - t_bp / (K * t)}
  if allreduce_s is not None:
    t = t_bp / K + (allreduce_s if K > 1 else 0.0)
    out["dp"] = {"tick_s": t, "speedup": t_bp / t, "allreduce_s": allreduce_s}
  return out


def bench_speedup(args, model, throughput_rows=None) -> dict:
  """Predicted (critical-path) and measured speed-ups at every K in --stages."""
  jax = _jax()
  dev = jax.devices()[0]
  batch = random_batch(model, args.batch_size, dev)
  info = device_info()
  if throughput_rows is None:
    sub = argparse.Namespace(**{**vars(args), "algorithms": list(ALGORITHMS)})
    throughput_rows = bench_throughput(sub, model)
  tp = {(r["algorithm"], r["num_stages"]): r for r in throughput_rows}
  bp1 = tp.get(("bp", 1))
  rows = []
  for K in args.stages:
    bounds, stages, params, states = build_stages(model, K, args.split, args.batch_size)
    times = stage_times(stages, params, states, batch, calls=args.ticks,
                        repeats=args.repeats, device=dev)
    transfers, how = [], "none (K=1)"
    for t in times[:-1]:
      c, how = transfer_time(t["out_bytes"], calls=args.ticks, repeats=args.repeats,
                             link_gbps=args.link_gbps, link_latency_us=args.link_latency_us)
      transfers.append(c)
    # The host's time to dispatch one tick on K devices, where the throughput run measured it.
    host = {a: tp[(a, K)]["host_time_s"]["median"] for a in ALGORITHMS
            if (a, K) in tp and tp[(a, K)]["placement"] != "1 device"}
    # Data parallelism's all-reduce: 2(K-1) transfers of 1/K of the parameters (ring).
    param_bytes = sum(tree_bytes(p) for p in params)
    allreduce = 0.0
    if K > 1:
      c, _ = transfer_time(max(param_bytes // K, 1), calls=args.ticks, repeats=args.repeats,
                           link_gbps=args.link_gbps, link_latency_us=args.link_latency_us)
      allreduce = 2 * (K - 1) * c
    pred = predict(times, transfers, args.microbatches, host_s=host or None,
                   allreduce_s=allreduce)
    distinct = len(jax.devices()) >= K
    meaningful = info["platform"] != "cpu" and distinct
    measured = {}
    for algorithm in PLANS:
      r = tp.get((algorithm, K))
      if r is not None and bp1 is not None:  # per interleaved repetition, then the median
        measured[algorithm] = statistics.median(
            b / x for b, x in zip(bp1["step_time_s"]["values"], r["step_time_s"]["values"]))
    rows.append({"num_stages": K, "boundaries": bounds, "stage_times": times,
                 "transfer_s": transfers, "transfer_source": how, "predicted": pred,
                 "measured_speedup": measured, "measured_placement":
                 tp[("fdg", K)]["placement"] if ("fdg", K) in tp else None,
                 "measured_meaningful": meaningful,
                 "note": None if meaningful else (
                     "forced CPU devices share the host's cores: the measured number is "
                     "contention, not a speed-up" if info["platform"] == "cpu" else
                     f"fewer than {K} devices: stages share one device")})
    _progress(f"speedup K={K}: predicted FDG x{pred['fdg']['speedup']:.2f}, "
              f"measured {measured.get('fdg', float('nan')):.2f}")
  return {"rows": rows, "microbatches": list(args.microbatches),
          "link": {"gbps": args.link_gbps, "latency_us": args.link_latency_us}}


def speedup_table(result) -> str:
  Ms = result["microbatches"]
  head = ("| K | stage tick ms (f+b) | transfer µs | FDG pred. sync | DDG pred. sync | "
          "FDG pred. async | DDG pred. async | "
          + " | ".join(f"GPipe = 1F1B M={m} pred. (bubble)" for m in Ms)
          + " | DP pred. | FDG meas. | DDG meas. | GPipe meas. | 1F1B meas. | meaningful |")
  lines = [head, "|" + "---|" * (13 + len(Ms))]
  for r in result["rows"]:
    p, m = r["predicted"], r["measured_speedup"]
    st = " / ".join(f"{1e3 * t['forward_s']:.2f}+{1e3 * t['backward_s']:.2f}"
                    for t in r["stage_times"])
    tr = " / ".join(f"{1e6 * c:.0f}" for c in r["transfer_s"]) or "–"
    gp = " | ".join(f"{p[f'gpipe_{M}']['speedup']:.2f} ({p[f'gpipe_{M}']['bubble']:.2f})"
                    for M in Ms)
    fm = lambda a: f"{m[a]:.2f}" if a in m else "–"
    hb = lambda a: " (host-bound)" if p[a].get("host_bound") else ""
    dp = f"{p['dp']['speedup']:.2f}" if "dp" in p else "–"
    lines.append(f"| {r['num_stages']} | {st} | {tr} | {p['fdg']['speedup']:.2f} | "
                 f"{p['ddg']['speedup']:.2f} | {p['fdg_async']['speedup']:.2f}"
                 f"{hb('fdg_async')} | {p['ddg_async']['speedup']:.2f}{hb('ddg_async')} | {gp} | "
                 f"{dp} | {fm('fdg')} | {fm('ddg')} | {fm('gpipe')} | {fm('1f1b')} | "
                 f"{'yes' if r['measured_meaningful'] else 'no'} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ CLI
def _progress(msg: str) -> None:
  print(f"  {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
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
  parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS),
                      choices=PLANS, help="the schedules of throughput (and speedup's "
                      "measured columns); gpipe and 1f1b run --sync_microbatches micro-batches")
  parser.add_argument("--sync_microbatches", type=int, default=4,
                      help="M of the gpipe and 1f1b throughput runs")
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
                      help="overhead: how the fused engine gates DDG's and FDG's stages during "
                      "the pipeline fill (Schedule's gate), each timed side by side")
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
                      help="M of the GPipe model")
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
    _jax().config.update("jax_num_cpu_devices", int(args.num_cpu_devices))
  info = device_info()
  global COMPUTE_DTYPE
  COMPUTE_DTYPE = args.dtype
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
        result["speedup"])))
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
