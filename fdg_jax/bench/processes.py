"""A pipeline across processes: what a message and a tick cost when stages sit in two processes.

    python -m fdg_jax.bench processes [--batch-size 32] [--width 256] [--ticks 100]

Starts itself as two JAX processes on this machine (`fdg_jax.launch`, one device each; on
CPU the cross-process collectives run over gloo on loopback) and, side by side, as one
process with two devices, and prints:

  exchange   ms per message moved from process 0's device to process 1's
             (`placement.exchange`, a two-sided ppermute program), per message size,
             against `jax.device_put` between two devices of one process;
  loop       µs per round of a device loop over both devices that moves a 32 KB block up
             and another down with `lax.ppermute` (the SPMD engine's exchange), against
             the same loop without the moves;
  tick       ms per FDG K=2 tick of an MLP (`--width`, 8 blocks, digits' shapes) through
             `step` and through `run`, stages in two processes vs two devices of one process,
             under the per-stage engine (a collective per message crossing) and the SPMD
             engine (`spmd step`, `spmd run`: the ticks as one program over both devices,
             the messages moved by `ppermute` inside it).

Both runs use one device per stage, so the difference is the cost of crossing processes
(the collective and its rendezvous) and of each process driving its stage only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MARK = "PROCESSES-BENCH "
SIZES_KB = (4, 64, 512, 4096)


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m fdg_jax.bench processes",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--width", type=int, default=256)
  p.add_argument("--ticks", type=int, default=100, help="timed ticks per measurement")
  p.add_argument("--repeats", type=int, default=3, help="timed runs; the best is printed")
  p.add_argument("--out", default=None, help="also write the figures to this JSON file")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def _best(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def _exchange_ms(src, dst, repeats: int, count: int = 20) -> dict:
  """ms per move of a float32 message of each size from device `src` to device `dst`."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from fdg_jax import placement
  one = lambda d: NamedSharding(Mesh(np.asarray([d], dtype=object), ("data",)), P("data"))
  out = {}
  for kb in SIZES_KB:
    rows = kb * 1024 // 4 // 256
    x = jax.device_put(np.ones((rows, 256), np.float32), one(src))
    move = lambda: jax.block_until_ready([placement.move(x, one(dst)) for _ in range(count)])
    move()
    out[kb] = 1e3 * _best(move, repeats) / count
  return out


def _loop_us(devices, repeats: int, rounds: int = 200) -> dict:
  """µs per round of a `fori_loop` over `devices` (a 2-device mesh) whose body moves a
  32 KB float32 block up and another down with `lax.ppermute`, and without the moves."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.asarray(devices, dtype=object), ("stage",))
  block = 32 * 256  # a [32, 256] float32 activation

  def program(moves: bool):
    def body(_, x):
      if not moves:
        return x * 1.0001 + 1
      up = jax.lax.ppermute(x, "stage", [(0, 1)])
      down = jax.lax.ppermute(x * 2, "stage", [(1, 0)])
      return up + down + 1
    return jax.jit(jax.shard_map(lambda x: jax.lax.fori_loop(0, rounds, body, x), mesh=mesh,
                                 in_specs=P("stage"), out_specs=P("stage")))

  x = jax.make_array_from_callback((2 * block,), NamedSharding(mesh, P("stage")),
                                   lambda index: np.ones(block, np.float32), dtype=np.float32)
  out = {}
  for name, moves in (("ppermute", True), ("none", False)):
    fn = program(moves)
    jax.block_until_ready(fn(x))
    out[name] = 1e6 * _best(lambda: jax.block_until_ready(fn(x)), repeats) / rounds
  return out


def _tick_ms(args, devices, engine: str) -> dict:
  """ms per FDG K=2 tick (MLP of 8 blocks) through `step` and `run`, stage k on devices[k]."""
  import jax
  import numpy as np
  import optax

  import fdg_jax
  from fdg_jax import models, partition
  model = models.create("mlp", num_classes=10, widths=(args.width,) * 8,
                        input_shape=(8, 8, 1))
  x1 = np.zeros((1, 8, 8, 1), np.float32)
  bounds = partition.boundaries(model, 2, "balanced", example_input=x1)
  stages = partition.stages_from_boundaries(model, bounds)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x1)
  schedule = fdg_jax.fdg(stages, optax_loss, optax.sgd(0.01, 0.9), devices=devices,
                         engine=engine)
  B, T = args.batch_size, args.ticks
  feeds = schedule.placement.feeder() is not None
  rows = schedule.placement.local_batch_slice(B) if feeds else slice(None)
  rng = np.random.default_rng(0)
  xs = rng.normal(size=(T, B, 8, 8, 1)).astype(np.float32)[:, rows]
  ys = rng.integers(0, 10, size=(T, B)).astype(np.int32)[:, rows]
  state = schedule.init(params, states, example_batch=(xs[0], ys[0]))

  def by_step():
    nonlocal state
    for t in range(T):
      state, _ = schedule.step(state, (xs[t], ys[t]))
    jax.block_until_ready(state["stages"])

  def by_run():
    nonlocal state
    state, _ = schedule.run(state, (xs, ys))
    jax.block_until_ready(state["stages"])

  by_step(), by_run()  # compile, fill the pipeline
  return {"step": 1e3 * _best(by_step, args.repeats) / T,
          "run": 1e3 * _best(by_run, args.repeats) / T}


def optax_loss(logits, labels):
  import optax
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def worker(args) -> None:
  import jax

  from fdg_jax import runtime
  runtime.initialize()
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[:2]
  result = {"processes": jax.process_count(),
            "exchange_ms": _exchange_ms(devices[0], devices[1], args.repeats),
            "loop_us": _loop_us(devices, args.repeats),
            "tick_ms": {}}
  for engine in ("per_stage", "spmd"):
    times = _tick_ms(args, devices, engine)
    prefix = "" if engine == "per_stage" else "spmd "
    result["tick_ms"].update({prefix + path: ms for path, ms in times.items()})
  if jax.process_index() == 0:
    print(MARK + json.dumps(result), flush=True)


def _collect(cmd, env) -> dict:
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
  for line in p.stdout.splitlines():
    if MARK in line:
      return json.loads(line.split(MARK, 1)[1])
  raise RuntimeError(f"benchmark worker failed ({p.returncode}):\n{p.stdout[-2000:]}\n"
                     f"{p.stderr[-2000:]}")


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.worker:
    worker(args)
    return {}
  me = [sys.executable, "-m", "fdg_jax.bench", "processes", "--worker",
        "--batch-size", str(args.batch_size), "--width", str(args.width),
        "--ticks", str(args.ticks), "--repeats", str(args.repeats)]
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  one = _collect(me, {**env, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2"})
  two = _collect([sys.executable, "-m", "fdg_jax.launch", "--num-processes", "2",
                  "--cpu-devices", "1", "--", *me], env)
  print(f"FDG K=2, MLP 8x{args.width}, batch {args.batch_size}, {args.ticks} ticks, "
        f"best of {args.repeats}; one device per stage")
  print(f"{'message':>10} {'1 process':>11} {'2 processes':>12}")
  for kb in SIZES_KB:
    a, b = one["exchange_ms"][str(kb)], two["exchange_ms"][str(kb)]
    print(f"{kb:>7} KB {a:>8.3f} ms {b:>9.3f} ms")
  print(f"{'loop':>10} {'1 process':>11} {'2 processes':>12}")
  for name in ("ppermute", "none"):
    a, b = one["loop_us"][name], two["loop_us"][name]
    print(f"{name:>10} {a:>8.1f} µs {b:>9.1f} µs")
  print(f"{'tick':>10} {'1 process':>11} {'2 processes':>12} {'ratio':>7}")
  for path in one["tick_ms"]:
    a, b = one["tick_ms"][path], two["tick_ms"][path]
    print(f"{path:>10} {a:>8.3f} ms {b:>9.3f} ms {b / a:>6.2f}x")
  figures = {"one_process": one, "two_processes": two, "args": vars(args)}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(figures, f, indent=1)
  return figures
