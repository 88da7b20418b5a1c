"""Measured speed-up on real cores: each device a process held to one core of this machine.

    python -m fdg_jax.bench cores [--model resnet20] [--model_kwargs '{"width": 8}']
        [--batch_size 128] [--stages 2] [--algorithms bp ddg fdg] [--replicas 2]
        [--split balanced] [--split_cost time] [--ticks 8] [--rounds 5] [--out F.json]
    python -m fdg_jax.bench cores --report F.json     # the table of a saved run

Forced XLA:CPU devices of one process share its thread pool, so they time contention, not
concurrency. Here every configuration is its own set of processes, each held to its cores
(sched_setaffinity before JAX starts) with one CPU device, the processes of one run joined
by `jax.distributed` (gloo on loopback, as `python -m fdg_jax.launch`):

  bp, 1 core             BP on one pinned core (the reference of `speedup`)
  bp, 2 cores, 1 device  BP in one process that may use both cores (XLA's intra-op threads:
                         what a user gets with no effort)
  bp, R replicas         BP data-parallel over R pinned processes (the global batch split,
                         gradients averaged: what a user with R devices tries first)
  ALG K=k                ALG's K stages, stage k in process k pinned to core k (bp K=k too:
                         the split without overlap, a control)

A K-stage row's boundaries are found once, before any row starts, by a process pinned to the
first core (`--split balanced --split_cost time`, the default: the split whose slowest stage
is fastest when each block is timed on this machine's core; `--split_cost flops` balances
XLA's FLOP counts, `--split 3` gives the boundaries), and every process of every row gets
the same ones; the table and `--out` print them.

The configurations start and compile one after the other; then `--rounds` rounds run them
one at a time in turn (the order rotated each round), `--ticks` ticks a round through
`schedule.run`, timed to `block_until_ready`. Each process reports its CPU seconds per wall
second over the round (about 1 for a pinned process that never waits: the check that the
cores are really working), printed next to the median samples/s and its [min, max].

On an accelerator machine the same script times what its devices give when `--cores` maps
a process to each (the figures there are per process, one device each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MARK = "CORES-BENCH "


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m fdg_jax.bench cores",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="resnet20")
  p.add_argument("--model_kwargs", type=json.loads, default=None,
                 help='JSON, e.g. \'{"width": 8}\' (resnet20: the published width 16)')
  p.add_argument("--input_shape", type=int, nargs=3, default=[28, 28, 1],
                 help="one example's shape (default Fashion-MNIST's 28 28 1)")
  p.add_argument("--batch_size", type=int, default=128, help="global batch per tick")
  p.add_argument("--stages", type=int, nargs="+", default=[2], help="values of K (one core "
                 "each: at most the cores this process may use)")
  p.add_argument("--algorithms", nargs="+", default=["bp", "ddg", "fdg"])
  p.add_argument("--replicas", type=int, default=2, help="R of the data-parallel BP row "
                 "(1: no such row)")
  p.add_argument("--split", default="balanced", help='"balanced", "uniform" or boundaries '
                 'such as "3" (K=2) or "2,3,5" (K=4)')
  p.add_argument("--split_cost", default="time", choices=("flops", "bytes", "time"),
                 help="what --split balanced balances (time: each block timed here)")
  p.add_argument("--ticks", type=int, default=8, help="ticks a timed round")
  p.add_argument("--rounds", type=int, default=5, help="timed rounds of each configuration")
  p.add_argument("--out", default=None, help="also write the rows to this JSON file")
  p.add_argument("--report", default=None, metavar="F.json",
                 help="print the table of a file --out wrote, measuring nothing")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def configurations(args, cores: list[int]) -> list[dict]:
  """The rows to measure: name, algorithm, K, R, processes and the cores of each."""
  n = len(cores)
  rows = [{"name": "bp, 1 core", "algorithm": "bp", "num_stages": 1, "replicas": 1,
           "cores": [[cores[0]]]}]
  if n >= 2:
    rows.append({"name": f"bp, {n} cores, 1 device", "algorithm": "bp", "num_stages": 1,
                 "replicas": 1, "cores": [list(cores)]})
  if 2 <= args.replicas <= n:
    rows.append({"name": f"bp, {args.replicas} replicas", "algorithm": "bp", "num_stages": 1,
                 "replicas": args.replicas, "cores": [[c] for c in cores[:args.replicas]]})
  for k in args.stages:
    if k < 2:
      continue
    if k > n:
      raise SystemExit(f"error: --stages {k} needs {k} cores, this process may use {n} "
                       f"({cores}); lower --stages")
    for alg in args.algorithms:
      rows.append({"name": f"{alg} K={k}, a stage per core", "algorithm": alg,
                   "num_stages": k, "replicas": 1, "cores": [[c] for c in cores[:k]]})
  return rows


# ------------------------------------------------------------------------------ a worker
def _loss(logits, labels):
  import optax
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def split_worker(spec: dict) -> None:
  """The boundaries of each K in spec["split_for"], printed once (the parent's one source)."""
  from fdg_jax import models, partition
  import jax.numpy as jnp
  model = models.create(spec["model"], num_classes=10, **(spec["model_kwargs"] or {}))
  x = jnp.zeros((spec["batch_size"],) + tuple(spec["input_shape"]), jnp.float32)
  how = partition.parse_split(spec["split"])
  out = {str(k): [int(b) for b in partition.boundaries(model, k, how, example_input=x,
                                                      cost=spec["split_cost"])]
         for k in spec["split_for"]}
  print(MARK + json.dumps(out), flush=True)


def boundaries(args, cores: list[int], ks: list[int]) -> dict[int, list[int]]:
  """{K: boundaries} for the K-stage rows, from one process pinned to the first core."""
  if not ks:
    return {}
  spec = {"model": args.model, "model_kwargs": args.model_kwargs, "batch_size":
          args.batch_size, "input_shape": args.input_shape, "split": args.split,
          "split_cost": args.split_cost, "split_for": ks}
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
  got = subprocess.run([sys.executable, "-m", "fdg_jax.bench", "cores", "--worker",
                        json.dumps(spec)], env=env, capture_output=True, text=True,
                       preexec_fn=lambda: os.sched_setaffinity(0, {cores[0]}))
  line = next((l for l in got.stdout.splitlines() if l.startswith(MARK)), None)
  if got.returncode or line is None:
    raise SystemExit(f"error: finding the split failed ({got.returncode}): "
                     f"{(got.stderr.strip().splitlines() or [''])[-1]}")
  return {int(k): v for k, v in json.loads(line[len(MARK):]).items()}


def worker(spec: dict) -> None:
  """One process of one configuration: builds, compiles, then times a round per "go"."""
  if "split_for" in spec:
    split_worker(spec)
    return
  from fdg_jax import runtime
  runtime.initialize()
  import jax
  import numpy as np
  import optax

  import fdg_jax
  from fdg_jax import models, partition
  from fdg_jax.trainer.prepare import choose_placement
  model = models.create(spec["model"], num_classes=10, **(spec["model_kwargs"] or {}))
  shape = tuple(spec["input_shape"])
  x1 = np.zeros((1,) + shape, np.float32)
  K, R, B, T = spec["num_stages"], spec["replicas"], spec["batch_size"], spec["ticks"]
  bounds = list(spec["bounds"]) if K > 1 else []
  stages = partition.stages_from_boundaries(model, bounds)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x1)
  where = choose_placement(K, R, "auto")
  schedule = fdg_jax.create(spec["algorithm"], stages, _loss,
                            optax.sgd(0.01, momentum=0.9), **where)
  feeds = schedule.placement.feeder() is not None
  rows = schedule.placement.local_batch_slice(B) if feeds else slice(None)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(T, B) + shape).astype(np.float32)[:, rows]
  ys = rng.integers(0, 10, size=(T, B)).astype(np.int32)[:, rows]
  state = schedule.init(params, states, example_batch=(xs[0], ys[0]))
  for _ in range(2):  # compile, and fill the pipeline past every warm-up variant
    state, _ = schedule.run(state, (xs, ys))
  jax.block_until_ready(state["stages"])
  me = jax.process_index()
  print(MARK + json.dumps({"ready": me}), flush=True)
  for line in sys.stdin:
    if line.strip() != "go":
      break
    wall0, cpu0 = time.perf_counter(), time.process_time()
    state, _ = schedule.run(state, (xs, ys))
    jax.block_until_ready(state["stages"])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    print(MARK + json.dumps({"process": me, "wall": wall, "cpu": cpu,
                             "affinity": sorted(os.sched_getaffinity(0))}), flush=True)


# ------------------------------------------------------------------------------ the parent
class Group:
  """The processes of one configuration, each pinned to its cores, fed "go" together."""

  def __init__(self, row: dict, spec: dict):
    from fdg_jax import launch
    self.row, self.procs = row, []
    n = len(row["cores"])
    coordinator = f"127.0.0.1:{launch.free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    for i, cores in enumerate(row["cores"]):
      env = dict(base, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONUNBUFFERED="1")
      if n > 1:
        env = launch.process_env(i, n, coordinator, 1, env)
      self.procs.append(subprocess.Popen(
          [sys.executable, "-m", "fdg_jax.bench", "cores", "--worker", json.dumps(spec)],
          env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True, preexec_fn=(lambda c=cores: os.sched_setaffinity(0, set(c)))))

  def _read(self, p) -> dict:
    for line in p.stdout:
      if line.startswith(MARK):
        return json.loads(line[len(MARK):])
    raise RuntimeError(f"{self.row['name']}: a worker ended ({p.wait()}):\n"
                       f"{p.stderr.read()[-3000:]}")

  def ready(self) -> None:
    for p in self.procs:
      self._read(p)

  def round(self) -> list[dict]:
    for p in self.procs:
      p.stdin.write("go\n")
      p.stdin.flush()
    return [self._read(p) for p in self.procs]

  def close(self) -> None:
    for p in self.procs:
      try:
        p.stdin.write("quit\n")
        p.stdin.close()
      except (BrokenPipeError, OSError):
        pass
    for p in self.procs:
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()


def measure(args) -> list[dict]:
  cores = sorted(os.sched_getaffinity(0))
  rows = configurations(args, cores)
  bounds = boundaries(args, cores, sorted({r["num_stages"] for r in rows if r["num_stages"] > 1}))
  for r in rows:
    r["boundaries"] = bounds.get(r["num_stages"], [])
  spec = {k: getattr(args, k) for k in ("model", "model_kwargs", "input_shape", "batch_size",
                                        "ticks")}
  groups = []
  try:
    for r in rows:  # one at a time: a process compiling beside others can miss gloo's
      groups.append(Group(r, {**spec, "algorithm": r["algorithm"],  # 30 s rendezvous
                              "num_stages": r["num_stages"], "replicas": r["replicas"],
                              "bounds": r["boundaries"]}))
      groups[-1].ready()
    walls = {r["name"]: [] for r in rows}
    cpu = {r["name"]: [] for r in rows}
    for i in range(args.rounds):
      for g in groups[i % len(groups):] + groups[:i % len(groups)]:
        got = g.round()
        walls[g.row["name"]].append(max(x["wall"] for x in got))
        cpu[g.row["name"]].append([x["cpu"] / x["wall"] for x in got])
  finally:
    for g in groups:
      g.close()
  samples = args.batch_size * args.ticks
  out = []
  for r in rows:
    w = walls[r["name"]]
    per_process = [statistics.median(c[j] for c in cpu[r["name"]])
                   for j in range(len(r["cores"]))]
    out.append({"name": r["name"], "algorithm": r["algorithm"], "num_stages": r["num_stages"],
                "replicas": r["replicas"], "processes": len(r["cores"]),
                "cores": len({c for cs in r["cores"] for c in cs}),
                "core_sets": r["cores"], "boundaries": r["boundaries"],
                "samples_per_s": samples / statistics.median(w),
                "samples_per_s_min": samples / max(w), "samples_per_s_max": samples / min(w),
                "step_s": statistics.median(w) / args.ticks, "round_walls_s": w,
                "cpu_per_wall": per_process})
  ref = out[0]["samples_per_s"]
  for row in out:
    row["speedup"] = row["samples_per_s"] / ref
  return out


def table(rows: list[dict], args) -> str:
  head = (f"{args.model} {json.dumps(args.model_kwargs or {})}, batch {args.batch_size}, "
          f"input {'x'.join(map(str, args.input_shape))}, {args.ticks} ticks a round, "
          f"{args.rounds} rounds in turn; median [min, max]")
  splits = sorted({(r["num_stages"], tuple(r["boundaries"])) for r in rows if r["boundaries"]})
  if splits:
    head += "\nsplit " + args.split + (f" by {args.split_cost}" if args.split == "balanced"
                                        else "") + ": " + "; ".join(
        f"K={k} boundaries {list(b)}" for k, b in splits)
  lines = [head, "", "| configuration | cores | processes | samples/s | step s | speed-up over "
           "bp, 1 core | CPU s per wall s, each process |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lo = r["samples_per_s_min"] / rows[0]["samples_per_s"]
    hi = r["samples_per_s_max"] / rows[0]["samples_per_s"]
    cpu = ", ".join(f"{c:.2f}" for c in r["cpu_per_wall"])
    lines.append(f"| {r['name']} | {r['cores']} | {r['processes']} | "
                 f"{r['samples_per_s']:.1f} [{r['samples_per_s_min']:.1f}, "
                 f"{r['samples_per_s_max']:.1f}] | {r['step_s']:.3f} | {r['speedup']:.2f}× "
                 f"[{lo:.2f}, {hi:.2f}] | {cpu} |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.worker:
    worker(json.loads(args.worker))
    return []
  if args.report:
    with open(args.report) as f:
      saved = json.load(f)
    print(table(saved["rows"], argparse.Namespace(**{**vars(args), **saved["args"]})))
    return saved["rows"]
  rows = measure(args)
  print(table(rows, args))
  if args.out:
    from fdg_jax.bench.common import device_info
    with open(args.out, "w") as f:
      json.dump({"command": "cores", "args": vars(args), "rows": rows,
                 "device": device_info(), "usable_cores": sorted(os.sched_getaffinity(0)),
                 "cpu_model": _cpu_model()}, f, indent=1)
  return rows


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    return ""
