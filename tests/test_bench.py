"""Benchmarks: the critical-path model against hand computation, the memory numbers against
partition's residual sizes, and smoke runs of `python -m fdg_jax.bench` and
`benchmarks/parity.py` at tiny sizes (valid JSON, expected keys, finite positive numbers; no
timing assertions)."""

import importlib.util
import json
import math
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fdg_jax import bench, delays, partition, plans
from fdg_jax.bench import timing

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _positive_finite(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_predict_matches_hand_computation():
  # K=3: f = (1, 2, 1), b = (2, 3, 2), so w = (3, 5, 3); transfers c = (0.5, 0.25).
  times = [{"forward_s": f, "backward_s": b, "tick_s": f + b}
           for f, b in [(1.0, 2.0), (2.0, 3.0), (1.0, 2.0)]]
  p = bench.predict(times, [0.5, 0.25], microbatches=[4])
  assert p["bp"]["tick_s"] == 11.0
  # FDG: every stage works at once; stage 1 (w = 5) ends at 5 and its cotangent crosses
  # boundary 0 in 0.5.
  assert p["fdg"]["tick_s"] == 5.5
  # DDG: stage 0 ends 0+1+2; stage 1 gets the activation at 1.5, ends 1.5+2+3+0.5;
  # the last stage gets it at 1.5+2+0.25 = 3.75 and ends 3.75+3+0.25.
  assert p["ddg"]["tick_s"] == 7.0
  # Asynchronous ticks: stage 1 alone (w1 = 5) is the heaviest cycle; the windows
  # (3+5+1)/2, (5+3+0.5)/2 and (11+1.5)/3 are lighter.
  assert p["ddg_async"]["tick_s"] == pytest.approx(5.0, rel=1e-6)
  assert p["fdg_async"]["tick_s"] == pytest.approx(5.0, rel=1e-6)
  assert p["fdg"]["speedup"] == pytest.approx(2.0)
  for name in ("gpipe", "1f1b"):
    ref = _pipeline_reference(plans.microbatch_order(name, 3, 4), [1.0, 2.0, 1.0],
                              [2.0, 3.0, 2.0], [0.5, 0.25])
    assert p[f"{name}_4"]["tick_s"] == pytest.approx(ref)
    assert p[f"{name}_4"]["bubble"] == pytest.approx(1 - 11.0 / (3 * ref))
  assert "dp" not in p
  dp = bench.predict(times, [0.5, 0.25], microbatches=[4], allreduce_s=1.0)["dp"]
  assert dp["tick_s"] == pytest.approx(11 / 3 + 1.0)  # the model on B/3, then the all-reduce
  # Transfers dominating: w = 1 per stage, c = 3 per boundary.
  slow = bench.predict([{"forward_s": 0.5, "backward_s": 0.5, "tick_s": 1.0}] * 3, [3.0, 3.0],
                       microbatches=[4])
  assert slow["fdg"]["tick_s"] == 4.0
  assert slow["fdg_async"]["tick_s"] == pytest.approx(4.0, rel=1e-6)  # (1+1+6)/2
  assert slow["ddg"]["tick_s"] == 11.0                  # 0.5+3+0.5+3, then 1+3
  assert slow["ddg_async"]["tick_s"] == pytest.approx(5.0, rel=1e-6)  # the chain: (3+12)/3
  # A host that needs 6 s to dispatch an FDG tick (and 4 s a DDG one) bounds the tick.
  hosted = bench.predict(times, [0.5, 0.25], microbatches=[4], host_s={"fdg": 6.0, "ddg": 4.0})
  assert hosted["fdg_async"]["tick_s"] == 6.0 and hosted["fdg_async"]["host_bound"]
  assert hosted["fdg_async"]["compute_tick_s"] == pytest.approx(5.0, rel=1e-6)
  assert hosted["ddg_async"]["tick_s"] == pytest.approx(5.0, rel=1e-6)
  assert not hosted["ddg_async"]["host_bound"]
  assert hosted["fdg"]["tick_s"] == 5.5  # the synchronous models ignore the host
  # One stage: every model is BP.
  one = bench.predict([{"forward_s": 1.0, "backward_s": 2.0, "tick_s": 3.0}], [], [4])
  assert all(v["speedup"] == pytest.approx(1.0) for v in one.values())
  assert {"bp", "fdg", "ddg", "ddg_async", "fdg_async", "gpipe_4", "1f1b_4"} <= set(one)


def _closed_forms(f, b, c):
  """docs/algorithms.md's tick orders as closed forms (the model before ticks were derived from
  plans): DDG synchronous, FDG and DDG asynchronous exactly; FDG synchronous as the bound
  max w + max c (stage k's messages cross its own boundaries only)."""
  K = len(f)
  w = [x + y for x, y in zip(f, b)]
  c = list(c) + [0.0]
  a, ends = 0.0, []
  for k in range(K - 1):
    ends.append(a + f[k] + b[k] + (c[k - 1] if k > 0 else 0.0))
    a += f[k] + c[k]
  ends.append(a + w[K - 1] + (c[K - 2] if K > 1 else 0.0))
  return {"ddg": max(ends), "fdg_bound": max(w) + max(c),
          "fdg_async": max([max(w)] + [(w[k] + w[k + 1] + 2 * c[k]) / 2 for k in range(K - 1)]),
          "ddg_async": max((sum(w[j:m + 1]) + 2 * sum(c[j:m])) / (m - j + 1)
                           for j in range(K) for m in range(j, K))}


@pytest.mark.parametrize("seed", range(8))
def test_the_plan_derived_model_is_the_closed_forms(seed):
  rng = np.random.default_rng(seed)
  K = 1 + seed % 6
  f, b = list(rng.uniform(0.2, 2.0, K)), list(rng.uniform(0.2, 3.0, K))
  c = list(rng.uniform(0.0, (0.5, 3.0)[seed % 2], K - 1))
  times = [{"forward_s": x, "backward_s": y, "tick_s": x + y} for x, y in zip(f, b)]
  p, ref = bench.predict(times, c, microbatches=[]), _closed_forms(f, b, c)
  assert p["ddg"]["tick_s"] == pytest.approx(ref["ddg"], rel=1e-12)
  assert p["fdg_async"]["tick_s"] == pytest.approx(ref["fdg_async"], rel=1e-9)
  assert p["ddg_async"]["tick_s"] == pytest.approx(ref["ddg_async"], rel=1e-9)
  assert max(f[k] + b[k] for k in range(K)) <= p["fdg"]["tick_s"] <= ref["fdg_bound"] + 1e-12
  if K > 1:  # equal transfers: the bound is the tick (every stage sends a message)
    same = [c[0]] * (K - 1)
    equal = bench.predict(times, same, microbatches=[])
    assert equal["fdg"]["tick_s"] == pytest.approx(_closed_forms(f, b, same)["fdg_bound"])


def _pipeline_reference(orders, f, b, c):
  """A synchronous pipeline's tick from each device's order of micro-batch actions, by a
  list scheduler independent of the plan: F(k, m) after F(k-1, m) and c_{k-1}/M; B(k, m)
  after stage k+1's backward of m (the last stage's is its forward: loss and gradient at
  once) and c_k/M; a device runs its actions in its order."""
  K, M = len(orders), max(m for o in orders for _, m in o) + 1
  done, free, pos = {}, [0.0] * K, [0] * K
  while any(pos[k] < len(orders[k]) for k in range(K)):
    for k in range(K):
      while pos[k] < len(orders[k]):
        kind, m = orders[k][pos[k]]
        if kind == "B" and k == K - 1:  # the last stage's backward ran with its forward
          done[("B", k, m)] = done[("F", k, m)]
          pos[k] += 1
          continue
        dep = (("F", k - 1, m) if k > 0 else None) if kind == "F" else ("B", k + 1, m)
        if dep is not None and dep not in done:
          break
        arrive = 0.0 if dep is None else done[dep] + (c[k - 1] if kind == "F" else c[k]) / M
        work = (f[k] + b[k] if k == K - 1 else f[k]) if kind == "F" else b[k]
        free[k] = max(free[k], arrive) + work / M
        done[(kind, k, m)] = free[k]
        pos[k] += 1
  return max(free)


@pytest.mark.parametrize("seed", range(4))
def test_synchronous_pipelines_match_a_list_scheduler(seed):
  rng = np.random.default_rng(100 + seed)
  K, M = 2 + seed % 3, (2, 4, 8, 3)[seed]
  f, b = list(rng.uniform(0.2, 2.0, K)), list(rng.uniform(0.2, 3.0, K))
  c = list(rng.uniform(0.0, 1.0, K - 1))
  times = [{"forward_s": x, "backward_s": y, "tick_s": x + y} for x, y in zip(f, b)]
  p = bench.predict(times, c, microbatches=[M])
  for name in ("gpipe", "1f1b"):
    ref = _pipeline_reference(plans.microbatch_order(name, K, M), f, b, c)
    assert p[f"{name}_{M}"]["tick_s"] == pytest.approx(ref, rel=1e-12), name
  # Equal stages and free transfers: 1F1B's tick is (M + K - 1) slots of a micro-batch's
  # forward and backward, its bubble (K - 1) / (M + K - 1).
  even = bench.predict([{"forward_s": 1.0, "backward_s": 2.0, "tick_s": 3.0}] * K,
                       [0.0] * (K - 1), microbatches=[M])
  assert even[f"1f1b_{M}"]["tick_s"] == pytest.approx((M + K - 1) / M * 3.0)
  assert even[f"1f1b_{M}"]["bubble"] == pytest.approx((K - 1) / (M + K - 1))


def test_a_registered_plan_gets_a_prediction():
  from fdg_jax import cost
  from fdg_jax.plans import Call, Plan

  def delayed_backprop(num_stages):
    K = num_stages
    calls = ([Call(0, True, False, "batch", None)] + [Call(k, True, False, "now", None)
                                                      for k in range(1, K - 1)]
             + [Call(K - 1, True, True, "now", None), Call(K - 2, False, True, None, "inbox")]
             + [Call(k, False, True, None, "now") for k in reversed(range(K - 2))])
    return Plan("delayed_backprop", K, tuple(calls))

  plans.register("delayed_backprop_bench", delayed_backprop, replace=True)
  times = [{"forward_s": f, "backward_s": b, "tick_s": f + b}
           for f, b in [(1.0, 2.0), (2.0, 3.0), (1.0, 2.0)]]
  p = bench.predict(times, [0.5, 0.25], microbatches=[])
  plan = delayed_backprop(3)
  assert p["delayed_backprop_bench"]["tick_s"] == cost.tick_time(
      plan, [1.0, 2.0, 1.0], [2.0, 3.0, 2.0], [0.5, 0.25])
  assert "delayed_backprop_bench_async" in p


def test_the_speedup_table_has_columns_for_the_schedules_asked_for():
  from fdg_jax.bench import speedup
  times = [{"forward_s": f, "backward_s": b, "tick_s": f + b, "out_bytes": 4}
           for f, b in [(1.0, 2.0), (2.0, 3.0)]]
  row = {"num_stages": 2, "stage_times": times, "transfer_s": [0.5],
         "predicted": bench.predict(times, [0.5], microbatches=[4], allreduce_s=1.0),
         "measured_speedup": {"bp": 0.5, "pipedream": 1.5}, "measured_meaningful": False}
  result = {"rows": [row], "microbatches": [4]}
  table = speedup.speedup_table(result, ["bp", "ddg", "pipedream", "gpipe"]).splitlines()
  head = [c.strip() for c in table[0].strip("|").split("|")]
  # BP is the reference: no column of its own
  assert head == ["K", "stage tick ms (f+b)", "transfer µs", "DDG pred. sync",
                  "PIPEDREAM pred. sync", "DDG pred. async", "PIPEDREAM pred. async",
                  "GPIPE M=4 pred. (bubble)", "DP pred.", "DDG meas.", "PIPEDREAM meas.",
                  "GPIPE meas.", "meaningful"]
  cells = [c.strip() for c in table[2].strip("|").split("|")]
  assert table[1].count("---") == len(head) == len(cells)
  assert cells[4] == f"{row['predicted']['pipedream']['speedup']:.2f}"
  assert cells[-4:] == ["–", "1.50", "–", "no"]  # measured: PipeDream only
  # No micro-batched pipeline asked for: every registered one is predicted (not measured).
  head = speedup.speedup_table(result, ["bp", "fdg"]).splitlines()[0]
  assert all(f"{n.upper()} M=4 pred." in head for n in plans.names(microbatched=True))
  assert "FDG meas." in head and "GPIPE meas." not in head


def _simulate(algorithm, f, b, c, ticks=3000):
  """Steady-state tick of the schedule's calls with asynchronous dispatch: each call starts
  when its device has finished its previous call and its inputs have arrived (+ c)."""
  K = len(f)
  w = [x + y for x, y in zip(f, b)]
  dev = [0.0] * K              # when each device finishes its last call
  cot = [0.0] * K              # when the cotangent for stage k (sent last tick) arrives
  act = [0.0] * K              # FDG: when the activation for stage k (sent last tick) arrives
  marks = []
  for _ in range(ticks):
    new_cot = [0.0] * K
    if algorithm == "ddg":
      ready = 0.0                                  # the batch is on device 0
      for k in range(K - 1):                       # forwards, in dispatch order
        dev[k] = max(dev[k], ready) + f[k]
        ready = dev[k] + c[k]
      dev[K - 1] = max(dev[K - 1], ready) + w[K - 1]  # the loss step
      if K > 1:
        new_cot[K - 2] = dev[K - 1] + c[K - 2]
      for k in reversed(range(K - 1)):             # delayed backwards
        dev[k] = max(dev[k], cot[k]) + b[k]
        if k > 0:
          new_cot[k - 1] = dev[k] + c[k - 1]
    else:  # fdg: one call per stage on last tick's messages
      new_act = [0.0] * K
      for k in range(K):
        dev[k] = max(dev[k], act[k], cot[k]) + w[k]
        if k < K - 1:
          new_act[k + 1] = dev[k] + c[k]
        if k > 0:
          new_cot[k - 1] = dev[k] + c[k - 1]
      act = new_act
    cot = new_cot
    marks.append(dev[K - 1])
  half = ticks // 2
  return (marks[-1] - marks[half - 1]) / (ticks - half)


@pytest.mark.parametrize("seed", range(6))
def test_async_models_match_simulation(seed):
  """The closed forms of ddg_async and fdg_async against an event simulation of the calls."""
  rng = np.random.default_rng(seed)
  K = 2 + seed % 4
  f, b = rng.uniform(0.2, 2.0, K), rng.uniform(0.2, 3.0, K)
  c = rng.uniform(0.0, (0.5, 3.0, 10.0)[seed % 3], K - 1)
  times = [{"forward_s": x, "backward_s": y, "tick_s": x + y} for x, y in zip(f, b)]
  p = bench.predict(times, list(c), microbatches=[4])
  for algorithm in ("ddg", "fdg"):
    assert _simulate(algorithm, f, b, list(c)) == pytest.approx(
        p[f"{algorithm}_async"]["tick_s"], rel=1e-2), algorithm
  # Transfers dominating: DDG's whole chain (3 stages, 2 ticks of round trips) is the cycle.
  f3, c3 = [0.5] * 3, [3.0, 3.0]
  assert _simulate("ddg", f3, f3, c3) == pytest.approx(5.0, rel=1e-2)
  assert _simulate("fdg", f3, f3, c3) == pytest.approx(4.0, rel=1e-2)


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "all.json"
  args = bench.parse_args([
      "all", "--model_kwargs", '{"widths": [16, 16, 16]}', "--input_shape", "8", "8", "1",
      "--batch_size", "8", "--stages", "1", "2", "--algorithms", "bp", "fdg", "1f1b",
      "--ticks", "2", "--repeats", "2",
      "--dispatch_ticks", "3", "--presets", "mlp_digits", "--microbatches", "4",
      "--out", str(out)])
  bench.run(args)
  with open(out) as f:
    return json.load(f)


def test_bench_all_writes_expected_json(bench_result):
  r = bench_result
  assert set(r) == {"meta", "throughput", "speedup", "overhead", "dispatch", "memory"}
  assert r["meta"]["platform"] == "cpu" and r["meta"]["num_devices"] == 4
  assert {(t["algorithm"], t["num_stages"]) for t in r["throughput"]} == {
      (a, k) for a in ("bp", "fdg", "1f1b") for k in (1, 2)}
  by = {(t["algorithm"], t["num_stages"]): t for t in r["throughput"]}
  # host calls per tick (per-stage engine): FDG K, BP 2K-1, 1F1B K M + (K-1) M + K (M = 4)
  assert [by[("fdg", k)]["host_calls_per_tick"] for k in (1, 2)] == [1, 2]
  assert [by[("bp", k)]["host_calls_per_tick"] for k in (1, 2)] == [1, 3]
  assert [by[("1f1b", k)]["host_calls_per_tick"] for k in (1, 2)] == [5, 14]
  assert by[("1f1b", 2)]["peak_stash"] == [2, 1]  # min(M, K - k) micro-batches
  assert by[("fdg", 2)]["peak_stash"][0] == 2  # 2(K-1-k) slots
  for t in r["throughput"]:
    assert t["loss_finite"]
    for key in ("step_time_s", "samples_per_s"):
      assert all(_positive_finite(t[key][s]) for s in ("median", "min", "max"))
  assert {t["placement"] for t in r["throughput"] if t["num_stages"] == 2} == {"2 devices"}

  rows = r["speedup"]["rows"]
  assert [row["num_stages"] for row in rows] == [1, 2]
  for row in rows:
    # every registered plan (BP's on the K devices too), and data parallelism
    assert {"bp", "bp_on_devices", "bp_on_devices_async", "fdg", "ddg", "fdg_async",
            "ddg_async", "gpipe_4", "1f1b_4", "dp"} <= set(row["predicted"])
    assert all(_positive_finite(v["speedup"]) for v in row["predicted"].values())
    assert not row["measured_meaningful"]  # forced CPU devices
    assert set(row["measured_speedup"]) == {"bp", "fdg", "1f1b"}
  assert len(rows[1]["transfer_s"]) == 1 and _positive_finite(rows[1]["transfer_s"][0])
  assert rows[1]["transfer_source"].startswith("measured")

  variants = {(o["algorithm"], o["num_stages"], o["backward"]) for o in r["overhead"]}
  assert variants == {("bp", 1, None), ("bp", 2, None), ("fdg", 2, "stash"),
                      ("fdg", 2, "recompute")}
  assert all(_positive_finite(o["ratio_vs_bp"]) and _positive_finite(o["ratio_of_minima"])
             for o in r["overhead"])

  for d in r["dispatch"]:
    per_stage, per_tick = d["host_time_per_stage_tick_s"], d["host_time_per_tick_s"]
    assert _positive_finite(per_stage["median"])
    assert per_stage["median"] == pytest.approx(per_tick["median"] / d["num_stages"])
    # The calling thread's CPU time over the same calls: positive, and never more than the
    # time they took (a process-wide clock would count the device threads' work too).
    cpu = d["host_cpu_time_per_stage_tick_s"]
    assert 0 < cpu["min"] and cpu["max"] <= per_stage["max"] + 1e-6


def test_overhead_times_compiler_option_and_gate_variants_side_by_side(tmp_path, capsys):
  out = tmp_path / "overhead.json"
  bench.run(bench.parse_args([
      "overhead", "--model_kwargs", '{"widths": [16, 16]}', "--input_shape", "8", "8", "1",
      "--batch_size", "8", "--stages", "2", "--algorithms", "fdg", "--ticks", "2",
      "--repeats", "1", "--paths", "run", "--run_ticks", "2",
      "--compiler_options", "default", "{}", "--gates", "mask", "cond", "--out", str(out)]))
  with open(out) as f:
    rows = json.load(f)["overhead"]
  assert [(r["compiler_options"], r["algorithm"], r["num_stages"]) for r in rows][::4] == [
      ("default", "bp", 1)] * 2 + [("{}", "bp", 1)] * 2 and len(rows) == 16
  assert [r.get("gate") for r in rows[:8]] == [None, "–", "mask", "mask",
                                               None, "–", "cond", "cond"]
  assert all(_positive_finite(r["ratio_vs_bp"]) for r in rows)
  printed = capsys.readouterr().out
  assert "| run T=2 | {} | cond | FDG | 2 |" in printed
  assert "| run T=2 | default | mask | FDG | 2 |" in printed


def test_memory_matches_residual_sizes(bench_result):
  """stash_bytes = (ring [+ head]) x slot + ring int32 batch indices, slot from `partition`."""
  rows = bench_result["memory"]
  # Every registered delayed tick plan with a backward policy: the built-ins, and any plan
  # registered before the run (test_a_registered_plan_gets_a_prediction registers one).
  delayed = [a for a in plans.names(microbatched=False, delayed=True)
             if "backward" in plans.spec(a).options]
  assert {"ddg", "fdg", "pipedream"} <= set(delayed)
  assert {(m["algorithm"], m["backward"]) for m in rows} == {
      (a, p) for a in delayed for p in ("stash", "recompute")}
  name, kwargs, shape, batch_size = bench.PRESETS["mlp_digits"]
  model = bench.build_model(name, kwargs, shape)
  x = model.example_input(batch_size)
  for m in rows:
    K, bounds = m["num_stages"], m["boundaries"]
    # FDG 2(K-1-k), DDG K-k (its forward stashes before its backward frees a slot),
    # PipeDream K-1-k (its backward frees one before its forward stashes).
    by_hand = {"fdg": lambda k: 2 * (K - 1 - k), "ddg": lambda k: K - k,
               "pipedream": lambda k: K - 1 - k}
    if m["algorithm"] in by_hand:
      rings = [by_hand[m["algorithm"]](k) for k in range(K - 1)] + [0]
    else:  # a registered plan: the ring its dataflow implies
      rings = list(plans.derive(plans.plan(m["algorithm"], K)).ring_sizes)
    assert list(m["ring_sizes"]) == rings
    held = [partition.ring_length(k, K, m["algorithm"]) for k in range(K)]
    heads = delays.ring_heads_default(jax.default_backend())  # the schedules' default
    assert held == [r + 1 if heads and r > 1 else r for r in rings]  # (the head)
    if m["backward"] == "stash":
      slots = partition.slot_bytes(model, bounds, x)
    else:  # the stage input (the RNG key is rebuilt from the batch index)
      infos = partition.block_info(model, x)
      slots = [int(np.prod(infos[a].input.shape)) * 4
               for a, _ in partition.stage_ranges(bounds, model.num_blocks)]
    assert m["stash_bytes"] == [h * s + 4 * r for h, r, s in zip(held, rings, slots)]
    assert m["ring_heads"] == heads and m["stash_bytes_total_with_heads"] == sum(
        (r + (r > 1)) * s + 4 * r for r, s in zip(rings, slots))
    assert m["param_bytes_total"] == 4 * sum(
        partition.param_count(i.params) for i in partition.block_info(model, x))
    assert m["bp_activation_bytes"] > 0


def test_parity_smoke(tmp_path):
  spec = importlib.util.spec_from_file_location("parity", ROOT / "benchmarks" / "parity.py")
  parity = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(parity)
  out, png = tmp_path / "parity.json", tmp_path / "parity.png"
  rc = parity.main([
      "--seeds", "0", "--stages", "2", "--betas", "1.0", "0.5", "--side_lrs", "0.1",
      "--side_betas", "1.0", "--side_stages", "2", "--set", "num_epochs=1",
      "--set", "batch_size=256",
      "--set", "model_kwargs.widths=(8, 8)", "--workdir", str(tmp_path / "runs"),
      "--out", str(out), "--plot", str(png)])
  assert rc == 0
  with open(out) as f:
    r = json.load(f)
  assert r["beta_search"]["chosen"]["2"] in (1.0, 0.5)
  assert len(r["beta_search"]["rows"]) == 2
  methods = [row["method"] for row in r["summary"]]
  assert methods[:3] == ["BP K=1", "DDG K=2", "FDG K=2 β=1"]
  for row in r["summary"] + r["side_summary"]:
    assert 0.0 <= row["test_accuracy_mean"] <= 1.0 and _positive_finite(row["wall_time_mean"])
  assert {row["method"] for row in r["side_summary"]} == {
      "BP K=1 m=0.9 lr=0.1", "FDG K=2 β=1 m=0.9 lr=0.1"}
  assert all(run["curve"] and run["curve"][-1]["epoch"] == 1 for run in r["runs"]
             if not run["diverged"])
  assert png.exists() and 0 < png.stat().st_size < 300_000


def test_one_cli_runs_every_benchmark(capsys):
  """`python -m fdg_jax.bench` also runs the concurrency and input-pipeline benchmarks."""
  from fdg_jax.bench.__main__ import main
  assert main(["concurrency", "--models", "tiny", "--stages", "2", "--ticks", "2",
               "--repeats", "1", "--batch-size", "8"]) == 0
  out = capsys.readouterr().out
  row = [l for l in out.splitlines() if l.startswith("tiny")]
  assert len(row) == 1 and all(_positive_finite(float(v)) for v in row[0].split()[2:])
  assert main(["data", "--num_examples", "256", "--batch_size", "32", "--num_batches", "3",
               "--prefetch", "0", "--repeats", "1", "--imagenet", "0"]) == 0
  rates = [float(l.split("median")[1].split()[0].replace(",", ""))
           for l in capsys.readouterr().out.splitlines() if "images/s" in l]
  assert len(rates) == 2 and all(r > 0 for r in rates)


def test_processes_benchmark_times_a_pipeline_across_two_processes(tmp_path, capsys):
  """`bench processes` launches two processes and one, and reports every figure."""
  from fdg_jax.bench.__main__ import main
  out = tmp_path / "processes.json"
  assert main(["processes", "--ticks", "3", "--repeats", "1", "--width", "32",
               "--out", str(out)]) == 0
  figures = json.loads(out.read_text())
  assert figures["two_processes"]["processes"] == 2
  assert figures["one_process"]["processes"] == 1
  for run in ("one_process", "two_processes"):
    values = (list(figures[run]["exchange_ms"].values())
              + list(figures[run]["loop_us"].values())
              + list(figures[run]["tick_ms"].values()))
    assert len(values) == 10 and all(_positive_finite(v) for v in values)
  assert "ratio" in capsys.readouterr().out


def test_nested_benchmark_times_every_program(tmp_path):
  from fdg_jax.bench.__main__ import main
  from fdg_jax.bench import nested
  out = tmp_path / "nested.json"
  assert main(["nested", "--batch", "2", "--size", "8", "--channels", "4", "--repeats", "1",
               "--out", str(out)]) == 0
  figures = json.loads(out.read_text())
  assert set(figures["ms"]) == {"top", "switch", "loop4", "scan4", "input", "input_scan4"}
  assert all(_positive_finite(v) for v in list(figures["ms"].values())
             + list(figures["ratios"].values()))
  # The programs compute what they say: the switch's branch 0 is the top-level gradient, and
  # the scan sums the same four gradients as the unrolled loop.
  progs = nested.programs(2, 8, 4)
  top, switch = (fn(*args) for fn, args in (progs["top"], progs["switch"]))
  np.testing.assert_allclose(np.asarray(switch), np.asarray(top), rtol=1e-5, atol=1e-5)
  loop, scan = (fn(*args) for fn, args in (progs["loop4"], progs["scan4"]))
  np.testing.assert_allclose(np.asarray(scan), np.asarray(loop), rtol=1e-4, atol=1e-4)


def test_dispatch_times_both_engines_on_a_data_stage_mesh(tmp_path, capsys):
  out = tmp_path / "dispatch.json"
  bench.run(bench.parse_args([
      "dispatch", "--stages", "2", "--replicas", "2", "--algorithms", "bp", "fdg",
      "--dispatch_ticks", "2", "--repeats", "1", "--paths", "run", "--run_ticks", "2",
      "--out", str(out)]))
  with open(out) as f:
    rows = json.load(f)["dispatch"]
  assert [(r["algorithm"], r["engine"], r["placement"], r["replicas"]) for r in rows] == [
      ("bp", "per_stage", "2x2 mesh", 2), ("fdg", "per_stage", "2x2 mesh", 2),
      ("fdg", "spmd", "2x2 mesh", 2)]  # the SPMD engine runs FDG only; no one-device row
  assert all(r["batch_size"] == 2 * 8 for r in rows)  # the tiny model's batch per replica
  assert all(_positive_finite(r["host_time_per_stage_tick_s"]["median"]) for r in rows)
  assert "| FDG | 2 | run T=2 | 2x2 mesh (spmd) |" in capsys.readouterr().out


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinities and 2 cores")
def test_pin_host_puts_the_caller_alone_on_a_core_and_restores_affinities(tmp_path):
  cores = sorted(os.sched_getaffinity(0))
  started, release, seen = threading.Event(), threading.Event(), {}

  def other():
    seen["tid"] = threading.get_native_id()
    started.set()
    release.wait()

  worker = threading.Thread(target=other)
  worker.start()
  started.wait()
  before = os.sched_getaffinity(seen["tid"])
  try:
    with timing.host_thread_pinned():
      assert sorted(os.sched_getaffinity(0)) == cores[:1]
      assert sorted(os.sched_getaffinity(seen["tid"])) == cores[1:]
    assert sorted(os.sched_getaffinity(0)) == cores
    assert os.sched_getaffinity(seen["tid"]) == before
  finally:
    release.set()
    worker.join()
  out = tmp_path / "dispatch.json"
  bench.run(bench.parse_args([
      "dispatch", "--stages", "2", "--algorithms", "fdg", "--engines", "fused",
      "--dispatch_ticks", "2", "--repeats", "1", "--paths", "run", "--run_ticks", "2",
      "--pin_host", "--out", str(out)]))
  with open(out) as f:
    rows = json.load(f)["dispatch"]
  assert [r["host_pinned"] for r in rows] == [True]
  assert _positive_finite(rows[0]["host_time_per_stage_tick_s"]["median"])
  assert sorted(os.sched_getaffinity(0)) == cores


def test_input_shape_resizes_a_globally_pooled_model_for_the_benchmarks():
  model = bench.build_model("resnet20", {}, (8, 8, 3))
  assert model.input_shape == (8, 8, 3)
  bounds, stages, params, states = bench.build_stages(model, 2, "balanced", 2)
  x = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 8, 3))
  h = x
  for stage, p, s in zip(stages, params, states):
    h, _ = stage.apply(p, s, h, train=False)
  assert h.shape == (2, 10)  # the head pools globally: any image size gives the logits
  full = model.module()
  variables = full.init(jax.random.PRNGKey(0), x, train=False)
  assert jax.tree.map(np.shape, variables["params"]) == jax.tree.map(
      np.shape, full.init(jax.random.PRNGKey(0), np.zeros((1, 32, 32, 3)),
                          train=False)["params"])  # the same weights as at 32x32
  with pytest.raises(ValueError, match=r"give \(H, W, 3\)"):
    bench.build_model("resnet20", {}, (8, 8))
  assert bench.build_model("mlp", {"widths": [8]}, (8, 8, 1)).input_shape == (8, 8, 1)


def test_dispatch_times_the_per_stage_engine_on_one_device_when_stages_outnumber_devices(
    tmp_path):
  out = tmp_path / "dispatch.json"
  K = len(jax.devices()) + 1  # 5 stages of the tiny model's 5 blocks on 4 devices
  bench.run(bench.parse_args([
      "dispatch", "--stages", str(K), "--algorithms", "fdg", "--engines", "per_stage",
      "fused", "--dispatch_ticks", "2", "--repeats", "1", "--paths", "step",
      "--out", str(out)]))
  with open(out) as f:
    rows = json.load(f)["dispatch"]
  assert [(r["engine"], r["placement"]) for r in rows] == [
      ("per_stage", f"{K} stages on 1 device"), ("fused", "1 device")]
  assert all(_positive_finite(r["host_time_per_stage_tick_s"]["median"]) for r in rows)


def test_loop_kernels_counts_what_one_iteration_runs():
  from fdg_jax.bench import hlo

  def program(num_dots):
    def body(i, carry):
      x, ws = carry
      for w in ws[:num_dots]:  # each product feeds the next: no two fuse into one
        x = jnp.tanh(x @ w)
      return x, ws
    return jax.jit(lambda x, ws: jax.lax.fori_loop(0, 3, body, (x, ws))[0])

  x = jnp.ones((4, 8))
  ws = tuple(jnp.eye(8) * (i + 1) for i in range(3))
  counts = [hlo.loop_kernels(program(n).lower(x, ws).compile().as_text()) for n in (1, 3)]
  assert sum(counts[1].values()) > sum(counts[0].values()) >= 1
  assert not set(counts[1]) & hlo.BOOKKEEPING
  tuple_typed = ("%while.1 = (s32[], f32[4,8]{1,0}, /*index=2*/f32[8,8]{1,0}) "
                 "while(%tuple.3), condition=%cond, body=%body")
  assert hlo.opcode(tuple_typed) == "while"
  assert hlo.opcode("ROOT %add.2 = f32[4]{0} add(%a, %b)") == "add"
  with pytest.raises(ValueError, match="no loop"):
    hlo.loop_kernels(jax.jit(jnp.sin).lower(x).compile().as_text())


def test_loop_kernels_count_a_conditional_with_its_largest_branch():
  from fdg_jax.bench import hlo

  def heavy(x, ws):
    for w in ws:
      x = jnp.tanh(x @ w)
    return x

  def program(gated):
    def body(i, carry):
      x, ws = carry
      if gated:  # the heavy branch, or nothing
        x = jax.lax.cond(i % 2 == 0, heavy, lambda x, ws: x, x, ws)
      else:
        x = heavy(x, ws)
      return x, ws
    return jax.jit(lambda x, ws: jax.lax.fori_loop(0, 3, body, (x, ws))[0])

  x = jnp.ones((4, 8))
  ws = tuple(jnp.eye(8) * (i + 1) for i in range(3))
  plain, gated = (hlo.loop_kernels(program(g).lower(x, ws).compile().as_text())
                  for g in (False, True))
  assert gated["conditional"] == 1 and "conditional" not in plain
  assert gated["dot"] + gated["fusion"] >= plain["dot"] + plain["fusion"] - 1
  assert sum(gated.values()) > sum(plain.values())
  assert hlo.branches("%c = f32[4]{0} conditional(%i, %a, %b), "
                      "branch_computations={%br_0, %br_1.clone}") == ["br_0", "br_1.clone"]
  assert hlo.branches("%c = f32[] conditional(%p, %a, %b), true_computation=%t, "
                      "false_computation=%f, metadata={}") == ["t", "f"]
  assert hlo.branches("%a = f32[] add(%x, %y)") == []


def test_gates_benchmark_times_both_gates_and_names_the_default(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("gates", ROOT / "benchmarks" / "gates.py")
  gates = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gates)
  out = tmp_path / "gates.json"
  r = gates.main(["--only", "0", "--repeats", "1", "--run_ticks", "2", "--budget_s", "0",
                  "--out", str(out)])
  row, = r["rows"]
  assert row["model"].endswith("(the quick start)")
  # 2 x 32 x 128 x 128 for a 128 x 128 layer, as XLA counts a stage's forward
  assert 2 * 32 * 128 * 128 <= row["forward_flops_max_stage"] <= 1.2 * 2 * 32 * 128 * 128
  assert row["default_gate"] == ("cond" if jax.default_backend() == "cpu" else "mask")
  assert _positive_finite(row["mask_tick_s"]) and _positive_finite(row["cond_over_mask"][0])
  assert json.loads(out.read_text())["rows"] == r["rows"]
  assert "| MLP 4x128, batch 32 (the quick start) |" in capsys.readouterr().out


def test_ring_cost_counts_kernels_and_the_weights_a_stash_writes(tmp_path, capsys):
  spec = importlib.util.spec_from_file_location("ring_cost", ROOT / "benchmarks" /
                                                "ring_cost.py")
  ring_cost = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(ring_cost)
  out = tmp_path / "ring_cost.json"
  r = ring_cost.main(["--repeats", "1", "--ticks", "4", "--run_ticks", "4", "--out",
                      str(out)])
  rows = {row["configuration"]: row for row in r["rows"]}
  kernels = {name: sum(row["kernels_per_tick"].values()) for name, row in rows.items()}
  assert kernels["FDG K=4"] > kernels["BP K=4"] > kernels["BP K=1"]
  assert kernels["FDG K=4, no ring write"] < kernels["FDG K=4"]
  # The gates: the default (chained conditionals on CPU), masks, unchained conditionals. A
  # conditional counts its largest branch's kernels: all of a stage's work.
  gates = {name: row["gate"] for name, row in rows.items()}
  assert gates["FDG K=4, masks"] == "mask" and gates["FDG K=4, conditionals unchained"] == "cond"
  assert gates["FDG K=4"] == ("cond" if jax.default_backend() == "cpu" else "mask")
  assert "conditional" not in rows["FDG K=4, masks"]["kernels_per_tick"]
  assert rows["FDG K=4, conditionals unchained"]["kernels_per_tick"]["conditional"] == 4
  assert kernels["FDG K=4, conditionals unchained"] > kernels["BP K=4"]
  # The quick-start MLP (64 -> 4 x 128) split uniformly: stages 0-2 each stash the Dense
  # kernel their forward used, 64x128, 128x128 and 128x128 float32 weights.
  assert r["stash_bytes_per_tick"]["weights"] == 4 * (64 * 128 + 2 * 128 * 128)
  assert r["stash_bytes_per_tick"]["total"] > r["stash_bytes_per_tick"]["weights"]
  assert r["stash_bytes_per_tick"]["per_stage"][-1] == 0  # the last stage keeps no ring
  assert "kernels per tick" in capsys.readouterr().out


def test_cores_runs_each_configuration_as_pinned_processes(tmp_path):
  """`python -m fdg_jax.bench cores` at a tiny size: every row's processes ran where the row
  says (one core each, or both for the one-device row), the speed-ups are over the first row
  and the JSON has the issue's fields. No timing assertion."""
  import subprocess
  import sys
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs two usable cores")
  out = tmp_path / "cores.json"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  env["FDG_JAX_COMPILATION_CACHE"] = "off"
  p = subprocess.run([sys.executable, "-m", "fdg_jax.bench", "cores", "--model", "mlp",
                      "--model_kwargs", '{"widths": [16, 16], "input_shape": [8, 8, 1]}',
                      "--input_shape", "8", "8", "1", "--batch_size", "16", "--ticks", "2",
                      "--rounds", "2", "--algorithms", "fdg", "--out", str(out)],
                     capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
  assert p.returncode == 0, p.stdout + p.stderr
  rows = json.loads(out.read_text())["rows"]
  assert [r["name"] for r in rows] == ["bp, 1 core", "bp, 2 cores, 1 device",
                                       "bp, 2 replicas", "fdg K=2, a stage per core"]
  assert [(r["cores"], r["processes"], r["replicas"], r["num_stages"]) for r in rows] == [
      (1, 1, 1, 1), (2, 1, 1, 1), (2, 2, 2, 1), (2, 2, 1, 2)]
  assert rows[0]["speedup"] == 1.0
  for r in rows:
    assert {"algorithm", "num_stages", "replicas", "cores", "samples_per_s", "speedup"} <= set(r)
    assert _positive_finite(r["samples_per_s"]) and len(r["round_walls_s"]) == 2
    assert len(r["cpu_per_wall"]) == r["processes"]
    # A process held to one core cannot use more than one core's seconds per second.
    if all(len(c) == 1 for c in r["core_sets"]):
      assert all(0 < c <= 1.05 for c in r["cpu_per_wall"])
  assert "| fdg K=2, a stage per core | 2 | 2 |" in p.stdout
