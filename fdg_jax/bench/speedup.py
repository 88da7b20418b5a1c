"""`python -m fdg_jax.bench speedup`: the predicted speed-up on K devices of every registered
schedule, from per-stage forward/backward times measured on one device and measured (or
assumed) transfer times (`predict`, through `fdg_jax.cost`: synchronous and asynchronous ticks
of each tick plan, each micro-batched pipeline at each M, and data parallelism), next to the
measured speed-up (throughput at K devices over BP at K=1), flagged as not meaningful on
forced CPU devices.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

from fdg_jax import plans as plans_lib
from fdg_jax.bench.common import (REFERENCE, build_stages, device_info, every_plan, loss_fn,
                                  optimizer, progress, random_batch, tick_plans, tree_bytes)
from fdg_jax.bench.throughput import bench_throughput
from fdg_jax.bench.timing import block


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
  import jax
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
  import jax
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
  plan-derived ticks equal the closed forms of docs/algorithms.md's tick orders (tested): DDG
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
  out = {REFERENCE: {"tick_s": t_bp, "speedup": 1.0}}
  for name in plans_lib.names(microbatched=False):
    try:
      plan = plans_lib.plan(name, K)
    except (ValueError, TypeError, IndexError):  # a user's plan not defined for this K
      continue
    key = name if name != REFERENCE else f"{REFERENCE}_on_devices"
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
  import jax
  dev = jax.devices()[0]
  batch = random_batch(model, args.batch_size, dev)
  info = device_info()
  if throughput_rows is None:
    sub = argparse.Namespace(**{**vars(args), "algorithms": list(tick_plans())})
    throughput_rows = bench_throughput(sub, model)
  tp = {(r["algorithm"], r["num_stages"]): r for r in throughput_rows}
  bp1 = tp.get((REFERENCE, 1))
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
    host = {a: tp[(a, K)]["host_time_s"]["median"] for a in tick_plans()
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
    for algorithm in every_plan():
      r = tp.get((algorithm, K))
      if r is not None and bp1 is not None:  # per interleaved repetition, then the median
        measured[algorithm] = statistics.median(
            b / x for b, x in zip(bp1["step_time_s"]["values"], r["step_time_s"]["values"]))
    # Every schedule measured at K ran on the same placement (`placement_for(K)`).
    placement = next((r["placement"] for (_, k), r in tp.items() if k == K), None)
    rows.append({"num_stages": K, "boundaries": bounds, "stage_times": times,
                 "transfer_s": transfers, "transfer_source": how, "predicted": pred,
                 "measured_speedup": measured, "measured_placement": placement,
                 "measured_meaningful": meaningful,
                 "note": None if meaningful else (
                     "forced CPU devices share the host's cores: the measured number is "
                     "contention, not a speed-up" if info["platform"] == "cpu" else
                     f"fewer than {K} devices: stages share one device")})
    shown = [a for a in args.algorithms if a != REFERENCE and a in pred]
    progress(f"speedup K={K}: predicted "
             + (", ".join(f"{a.upper()} x{pred[a]['speedup']:.2f}" for a in shown) or "–")
             + "; measured "
             + (", ".join(f"{a.upper()} x{measured[a]:.2f}" for a in shown if a in measured)
                or "–"))
  return {"rows": rows, "microbatches": list(args.microbatches),
          "link": {"gbps": args.link_gbps, "latency_us": args.link_latency_us}}


def table_schedules(algorithms=None) -> tuple[list[str], list[str]]:
  """The schedules `speedup_table` gives columns to: (tick plans, micro-batched pipelines).

  Those of `algorithms` (default: every registered schedule) but the reference BP, in their
  order. When `algorithms` names no micro-batched pipeline, every registered one: their
  predictions at each M of --microbatches need no run of them.
  """
  names = every_plan() if algorithms is None else list(algorithms)
  names = [a for a in names if a != REFERENCE]
  ticks = [a for a in names if not plans_lib.spec(a).microbatched]
  pipelines = ([a for a in names if plans_lib.spec(a).microbatched]
               or list(plans_lib.names(microbatched=True)))
  return ticks, pipelines


def speedup_table(result, algorithms=None) -> str:
  """`bench_speedup`'s result as a markdown table: one row per K; the predicted speed-up of
  each tick plan of `algorithms` (--algorithms) with synchronous ticks, then with
  asynchronous ones (host-bound where the host's dispatch is the longer), each micro-batched
  pipeline's at each M with its bubble, data parallelism's, then each schedule's measured
  speed-up (`table_schedules` says which; BP K=1 is the reference of every number)."""
  Ms = result["microbatches"]
  ticks, pipelines = table_schedules(algorithms)
  measured = ticks + [a for a in pipelines if algorithms is None or a in algorithms]
  heads = (["K", "stage tick ms (f+b)", "transfer µs"]
           + [f"{a.upper()} pred. sync" for a in ticks]
           + [f"{a.upper()} pred. async" for a in ticks]
           + [f"{a.upper()} M={m} pred. (bubble)" for a in pipelines for m in Ms]
           + ["DP pred."] + [f"{a.upper()} meas." for a in measured] + ["meaningful"])
  lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
  for r in result["rows"]:
    p, m = r["predicted"], r["measured_speedup"]
    st = " / ".join(f"{1e3 * t['forward_s']:.2f}+{1e3 * t['backward_s']:.2f}"
                    for t in r["stage_times"])
    tr = " / ".join(f"{1e6 * c:.0f}" for c in r["transfer_s"]) or "–"
    # "–" where a plan has no prediction at this K (a user's plan not defined for it)
    sp = lambda k: f"{p[k]['speedup']:.2f}" if k in p else "–"
    hb = lambda k: " (host-bound)" if p.get(k, {}).get("host_bound") else ""
    gp = lambda k: f"{p[k]['speedup']:.2f} ({p[k]['bubble']:.2f})" if k in p else "–"
    cells = ([str(r["num_stages"]), st, tr] + [sp(a) for a in ticks]
             + [sp(f"{a}_async") + hb(f"{a}_async") for a in ticks]
             + [gp(f"{a}_{M}") for a in pipelines for M in Ms]
             + [sp("dp")] + [f"{m[a]:.2f}" if a in m else "–" for a in measured]
             + ["yes" if r["measured_meaningful"] else "no"])
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
