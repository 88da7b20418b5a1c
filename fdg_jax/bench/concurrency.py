"""Per-tick host (dispatch) time vs device time of the FDG schedule, K stages on K devices.

For each model and K it prints, per steady-state tick (milliseconds):

  dispatch   time inside `Schedule.step` (the host enqueues K stage steps and the message
             moves, and returns without waiting), while the devices are busy with earlier
             ticks (the steady state);
  disp_idle  the same, measured when the devices are idle (every tick waited for): on a
             CPU backend the gap to `dispatch` is the host thread competing with XLA's;
  tick       wall time per tick of a run of ticks, blocking only at the end (the pipeline's
             throughput: stages of one tick may overlap each other and the next dispatch);
  tick_sync  wall time per tick when every tick is waited for (no overlap across ticks);
  sum_stage  sum over stages of each stage's step run alone on its device, waited for (the
             work of one tick done one stage after the other);
  max_stage  the slowest of those (the ideal tick when the K stages run concurrently);
  overlap    sum_stage / tick: how many stages' work a tick overlaps (K at best).

Stages get devices 0..K-1 of the default backend, round robin when there are fewer. On CPU
the script asks for `--cpu-devices` host devices; they share the machine's cores, so overlap is
bounded by the cores XLA can use, not by K.

    python -m fdg_jax.bench concurrency --models tiny resnet20 --stages 1 2 4 --batch-size 32
"""

from __future__ import annotations

import argparse
import statistics
import time

from fdg_jax import plans


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m fdg_jax.bench concurrency",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--models", nargs="+", default=["tiny", "resnet20"],
                 help="'tiny' (an MLP of three 64-wide layers on 32 features) or a registry name")
  p.add_argument("--stages", nargs="+", type=int, default=[1, 2, 4])
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--ticks", type=int, default=10, help="timed steady-state ticks")
  p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is printed")
  # The default is the schedule this benchmark was written for; any tick plan runs.
  p.add_argument("--algorithm", default="fdg", choices=list(plans.names(microbatched=False)))
  p.add_argument("--cpu-devices", type=int, default=4)
  return p.parse_args(argv)


def build(name: str, num_stages: int, batch_size: int, algorithm: str, devices):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import fdg_jax
  from fdg_jax import models, partition

  if name == "tiny":
    model = models.create("mlp", widths=(64, 64, 64), input_shape=(32,))
  else:
    model = models.create(name)
  x1 = model.example_input(1)
  stages = partition.split(model, num_stages, "uniform", example_input=x1)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), jnp.zeros(x1.shape))
  rng = np.random.RandomState(0)
  x = rng.randn(batch_size, *model.input_shape).astype(np.float32)
  y = rng.randint(0, model.num_classes, batch_size).astype(np.int32)
  loss = lambda logits, labels: optax.softmax_cross_entropy_with_integer_labels(
      logits, labels).mean()
  kwargs = {}
  sched = fdg_jax.create(algorithm, stages, loss, optax.sgd(0.01, momentum=0.9),
                         devices=[devices[k % len(devices)] for k in range(num_stages)],
                         engine="per_stage", **kwargs)
  state = sched.init(params, states)
  batch = sched.placement.put_batch(0, (x, y))
  return sched, state, batch


def timed_ticks(sched, state, batch, ticks: int, sync: bool):
  """(state, mean dispatch seconds, wall seconds per tick)."""
  import jax
  jax.block_until_ready(state)
  dispatch = []
  start = time.perf_counter()
  for _ in range(ticks):
    t0 = time.perf_counter()
    state, _ = sched.step(state, batch)
    dispatch.append(time.perf_counter() - t0)
    if sync:
      jax.block_until_ready(state)
  jax.block_until_ready(state)
  return state, statistics.mean(dispatch), (time.perf_counter() - start) / ticks


def stage_times(sched, state, batch, ticks: int) -> list[float]:
  """Seconds of each stage's steady-state step run alone (waited for), in stage order.

  Uses the schedule's own jitted stage steps on copies of the steady-state stage states and
  the messages waiting in the inbox, so this is exactly the work a tick dispatches.
  """
  import jax
  K = sched.num_stages
  out = []
  for k in range(K):
    s = jax.tree.map(lambda a: a.copy(), state["stages"][k])
    fn = sched.engine_impl.stage_call(k, True, True)
    act = batch if k == 0 else state["inbox"][k].get("act")
    cot = state["inbox"][k].get("cot") if k < K - 1 else None
    run = lambda s, fn=fn, act=act, cot=cot: fn(s, act, cot)[0]
    s = jax.block_until_ready(run(s))  # compiled already; one untimed call
    times = []
    for _ in range(ticks):
      t0 = time.perf_counter()
      s = jax.block_until_ready(run(s))
      times.append(time.perf_counter() - t0)
    out.append(statistics.median(times))
  return out


def main(argv=None):
  args = parse_args(argv)
  import jax
  try:  # effective only before the CPU backend starts; ignored by GPU/TPU backends
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  except Exception:  # noqa: BLE001 - a backend already running keeps its devices
    pass
  devices = jax.devices()
  print(f"backend {jax.default_backend()}, {len(devices)} devices ({devices[0].device_kind}), "
        f"{args.algorithm}, batch {args.batch_size}, {args.ticks} ticks x {args.repeats} runs")
  print(f"{'model':10s} {'K':>2s} {'dispatch':>9s} {'disp_idle':>9s} {'tick':>9s} "
        f"{'tick_sync':>9s} "
        f"{'sum_stage':>9s} {'max_stage':>9s} {'overlap':>7s}   (ms per tick)")
  for name in args.models:
    for K in args.stages:
      sched, state, batch = build(name, K, args.batch_size, args.algorithm, devices)
      # Warm-up: past the schedule's warm-up ticks, every stage variant compiled.
      state, _, _ = timed_ticks(sched, state, batch, 2 * K + 1, sync=True)
      runs = {"dispatch": [], "disp_idle": [], "tick": [], "tick_sync": []}
      for _ in range(args.repeats):
        state, dispatch, tick = timed_ticks(sched, state, batch, args.ticks, sync=False)
        state, disp_idle, tick_sync = timed_ticks(sched, state, batch, args.ticks, sync=True)
        for key, v in (("dispatch", dispatch), ("disp_idle", disp_idle), ("tick", tick),
                       ("tick_sync", tick_sync)):
          runs[key].append(v)
      med = {key: statistics.median(v) * 1e3 for key, v in runs.items()}
      stages = [t * 1e3 for t in stage_times(sched, state, batch, args.ticks)]
      print(f"{name:10s} {K:2d} {med['dispatch']:9.2f} {med['disp_idle']:9.2f} {med['tick']:9.2f} "
            f"{med['tick_sync']:9.2f} {sum(stages):9.2f} {max(stages):9.2f} "
            f"{sum(stages) / med['tick']:7.2f}")


if __name__ == "__main__":
  main()

