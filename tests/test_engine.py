"""The engines: `run` (T ticks per call) and the fused one-device program equal `step`.

The reference is the per-stage engine's `step` on separate devices, itself checked against
the independent simulator in test_schedules.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax.placement import make_mesh
from toy_models import assert_trees_close, batches, loss_fn, make_model


def dropout_apply(params, model_state, x, *, train=True, rng=None):
  """Dense -> tanh -> dropout(0.25): a stage whose result depends on its RNG key."""
  h = jnp.tanh(x @ params["w"] + params["b"])
  if train and rng is not None:
    keep = jax.random.bernoulli(rng, 0.75, h.shape)
    h = jnp.where(keep, h / 0.75, 0.0)
  return h, model_state


def model(kind, K):
  applies, params, states = make_model("bn" if kind == "bn" else "mlp", K)
  if kind == "dropout":
    applies = [dropout_apply] * (K - 1) + applies[-1:]
  return [fdg_jax.Stage(apply=a) for a in applies], params, states


def stacked(data):
  return (np.stack([np.asarray(x) for x, _ in data]), np.stack([np.asarray(y) for _, y in data]))


def snapshot(sched, state):
  """Everything a tick changes, unpacked: per stage core state and stash, and the inbox."""
  K = sched.num_stages
  stages = [jax.device_get(sched.stage_state(state, k)) for k in range(K)]
  stashes = [jax.device_get(sched.stash(state, k)) for k in range(K)]
  return stages, stashes, jax.device_get(state["inbox"])


def by_steps(sched, params, states, data):
  state = sched.init(params, states)
  trace = []
  for b in data:
    state, m = sched.step(state, b)
    trace.append([-1 if u is None else int(u) for u in m["updated"]])
  return state, trace


def by_steps_and_runs(sched, params, states, data, lengths):
  """Consecutive chunks of `data` of the given lengths over one state: `step` for a chunk
  of 1, `run` otherwise. Returns (state, `updated` trace, losses: None where no loss)."""
  state = sched.init(params, states)
  xs, ys = stacked(data)
  trace, losses, start = [], [], 0
  for n in lengths:
    if n == 1:
      state, m = sched.step(state, data[start])
      trace.append([-1 if u is None else int(u) for u in m["updated"]])
      losses.append(float(m["loss"]) if "loss" in m else None)
    else:
      state, m = sched.run(state, (xs[start:start + n], ys[start:start + n]))
      trace += np.asarray(m["updated"]).tolist()
      losses += [float(l) if v else None for l, v in zip(np.asarray(m["loss"]),
                                                          np.asarray(m["valid"]))]
    start += n
  return state, trace, losses


def by_runs(sched, params, states, data, lengths, pad=0):
  """`run` over consecutive chunks of `data` of the given lengths (buffers padded by `pad`)."""
  state = sched.init(params, states)
  xs, ys = stacked(data)
  trace, start = [], 0
  for n in lengths:
    chunk = (np.concatenate([xs[start:start + n], np.zeros_like(xs[:pad])]),
             np.concatenate([ys[start:start + n], np.zeros_like(ys[:pad])]))
    state, m = sched.run(state, chunk, num_ticks=n)
    assert list(m["tick"][:n]) == list(range(start, start + n))
    assert list(m["tick"][n:]) == [-1] * pad
    assert not np.asarray(m["valid"])[n:].any()
    trace += np.asarray(m["updated"])[:n].tolist()
    start += n
  assert start == len(data)
  return state, trace


CASES = [("bp", 1.0, "stash"), ("ddg", 1.0, "stash"), ("ddg", 1.0, "recompute"),
         ("fdg", 0.5, "stash"), ("fdg", 1.0, "recompute")]


@pytest.mark.parametrize("kind", ["bn", "dropout"])
@pytest.mark.parametrize("algorithm,beta,backward", CASES)
def test_run_and_fused_engine_equal_per_stage_steps(algorithm, beta, backward, kind):
  K = 3
  stages, params, states = model(kind, K)
  data = batches(13)
  kwargs = {"backward": backward} if algorithm != "bp" else {}
  if algorithm == "fdg":
    kwargs["beta"] = beta
  make = lambda **kw: fdg_jax.create(algorithm, stages, loss_fn,
                                     optax.chain(optax.add_decayed_weights(1e-3),
                                                 optax.sgd(0.05, momentum=0.9)),
                                     **kwargs, **kw)
  ref = make(devices=jax.devices()[:K])
  assert ref.engine == "per_stage"
  ref_state, ref_trace = by_steps(ref, params, states, data)
  expected = snapshot(ref, ref_state)
  runs = {
      "fused step": lambda s: by_steps(s, params, states, data),
      "fused run (loop)": lambda s: by_runs(s, params, states, data, [1, 4, 8], pad=2),
      "fused run (per tick)": lambda s: by_runs(s, params, states, data, [5, 8]),
      "per-stage run": lambda s: by_runs(s, params, states, data, [6, 7], pad=1),
      # the rings' heads, under XLA's own options (the default off CPU)
      "per-stage run, heads": lambda s: by_runs(s, params, states, data, [6, 7], pad=1),
      "fused run (loop), heads": lambda s: by_runs(s, params, states, data, [5, 8]),
      # the gate the platform does not pick for this schedule (masks or conditionals)
      "fused step, other gate": lambda s: by_steps(s, params, states, data),
      "fused run (loop), other gate": lambda s: by_runs(s, params, states, data, [3, 10]),
  }
  probe = make()
  probe.init(params, states, example_batch=data[0])
  default_gate = probe.gate
  if jax.default_backend() == "cpu":  # `Schedule.gate`: small FDG ticks with stash
    assert default_gate == ("cond" if (algorithm, backward) == ("fdg", "stash") else "mask")
  for name, go in runs.items():
    heads = {"ring_heads": True, "compiler_options": {}} if "heads" in name else {}
    if "other gate" in name:
      heads["gate"] = {"cond": "mask", "mask": "cond"}[default_gate]
    if name.startswith("per-stage run"):
      sched = make(devices=jax.devices()[:K], **heads)
    else:
      sched = make(scan=name != "fused run (per tick)", **heads)
      assert sched.engine == "fused"
    state, trace = go(sched)
    assert trace == ref_trace, name
    got = snapshot(sched, state)
    assert_trees_close(got[0], expected[0], atol=1e-6)
    assert_trees_close(got[1], expected[1], atol=1e-6)
    assert_trees_close(got[2], expected[2], atol=1e-6)
  # Non-vacuous: every stage trained, and dropout changed the forward.
  final = ref.params(ref_state)
  for k in range(K):
    assert not np.allclose(np.asarray(final[k]["w"]), np.asarray(params[k]["w"]))


def test_run_metrics_match_step_metrics():
  K = 3
  stages, params, states = model("bn", K)
  data = batches(9)
  sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05))
  state = sched.init(params, states)
  losses = []
  for b in data:
    state, m = sched.step(state, b)
    losses.append(float(m["loss"]) if "loss" in m else None)
  sched2 = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05))
  _, m = sched2.run(sched2.init(params, states), stacked(data))
  valid = np.asarray(m["valid"])
  assert valid.tolist() == [l is not None for l in losses] == [t >= K - 1 for t in range(9)]
  np.testing.assert_allclose(np.asarray(m["loss"])[valid], [l for l in losses if l is not None],
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(m["batch"])[valid], np.arange(9 - (K - 1)))


def test_run_compiles_once_per_buffer_length():
  K = 3
  stages, params, states = model("bn", K)
  data = batches(20)
  sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05))
  state = sched.init(params, states)
  xs, ys = stacked(data)
  start = 0
  for n in (8, 3, 8, 1):  # through the fill and past it, several lengths, one buffer length
    chunk = tuple(np.concatenate([a[start:start + n], np.zeros_like(a[:8 - n])])
                  for a in (xs, ys))
    state, _ = sched.run(state, chunk, num_ticks=n)
    start += n
  assert sched.engine_impl.fns[("fused", 8)]._cache_size() == 1
  assert [key for key in sched.engine_impl.fns if key[0] == "fused"] == [("fused", 8)]


def test_state_is_a_few_buffers_per_stage():
  """The packed state: a call carries a handful of buffers, however many leaves a stage has."""
  K = 3
  stages, params, states = model("bn", K)
  sched = fdg_jax.fdg(stages, loss_fn, optax.adam(1e-2))
  state = sched.init(params, states, example_batch=batches(1)[0])
  for k in range(K):
    core = state["stages"][k]["core"]
    # float32 (params, BN statistics, Adam moments), int32 (counters, Adam count, batch
    # indices) and uint32 (the stage key).
    assert sorted(core) == ["float32", "int32", "uint32"]
    unpacked = sched.stage_state(state, k)
    assert len(jax.tree.leaves(unpacked)) > 3 * len(core)
    assert_trees_close(unpacked["params"], params[k], atol=0)


def test_layout_pads_and_unpacks_longer_buffers():
  """`packing.Layout`: per-dtype buffers, their sizes and leaf offsets, zero padding, and
  unpacking from padded buffers (the SPMD engine's vectors)."""
  from fdg_jax.packing import Layout
  tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.arange(4, dtype=jnp.int32),
          "c": jnp.full((2,), 7.0)}
  lay = Layout.of(tree)
  assert lay.sizes == {"float32": 8, "int32": 4}
  assert lay.offsets == (0, 0, 6)  # a, b, c: c follows a in the float32 buffer
  packed = lay.pack(tree, {"float32": 10, "int32": 4, "bool": 3})
  assert {n: v.shape for n, v in packed.items()} == {"float32": (10,), "int32": (4,),
                                                      "bool": (3,)}
  np.testing.assert_array_equal(packed["float32"], [0, 1, 2, 3, 4, 5, 7, 7, 0, 0])
  assert not packed["bool"].any()
  assert_trees_close(lay.unpack(packed), tree, atol=0)


def core_and_stash(sched, state):
  """Every stage's unpacked core state and stash ring, whatever the engine's layout."""
  K = sched.num_stages
  return ([jax.device_get(sched.stage_state(state, k)) for k in range(K)],
          [jax.device_get(sched.stash(state, k)) for k in range(K)])


@pytest.mark.parametrize("K,kind,beta,backward,optimizer", [
    (2, "bn", 0.5, "stash", "sgd"),
    (3, "dropout", 1.0, "recompute", "sgd"),
    (3, "bn", 1.0, "stash", "adam"),
])
def test_spmd_engine_equals_per_stage_steps(K, kind, beta, backward, optimizer):
  """One program over the K devices (`run`, and `step` as run with T = 1) equals the
  per-stage engine's steps: state, stash, `updated` trace and losses."""
  stages, params, states = model(kind, K)
  data = batches(13)
  opt = (optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.05, momentum=0.9))
         if optimizer == "sgd" else optax.adam(1e-2))
  make = lambda **kw: fdg_jax.fdg(stages, loss_fn, opt, beta=beta, backward=backward,
                                  devices=jax.devices()[:K], **kw)
  ref = make()
  ref_state = ref.init(params, states)
  ref_trace, ref_losses = [], []
  for b in data:
    ref_state, m = ref.step(ref_state, b)
    ref_trace.append([-1 if u is None else int(u) for u in m["updated"]])
    ref_losses.append(float(m["loss"]) if "loss" in m else None)
  expected = core_and_stash(ref, ref_state)
  for how in ("run", "step", "mixed"):
    sched = make(engine="spmd")
    assert sched.engine == "spmd"
    if how == "run":
      state, trace = by_runs(sched, params, states, data, [1, 4, 8], pad=2)
    elif how == "step":
      state, trace = by_steps(sched, params, states, data)
    else:  # steps and runs of several lengths over one state
      state, trace, losses = by_steps_and_runs(sched, params, states, data, (3, 1, 5, 1, 3))
      assert losses == pytest.approx(ref_losses, abs=1e-6), how
    assert trace == ref_trace, how
    got = core_and_stash(sched, state)
    assert_trees_close(got[0], expected[0], atol=1e-6)
    assert_trees_close(got[1], expected[1], atol=1e-6)
  final = ref.params(ref_state)
  for k in range(K):  # non-vacuous: every stage trained
    assert not np.allclose(np.asarray(final[k]["w"]), np.asarray(params[k]["w"]))


def test_spmd_engine_compiles_once_per_buffer_length_and_keeps_few_buffers():
  K = 2
  stages, params, states = model("bn", K)
  data = batches(20)
  sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05), devices=jax.devices()[:K],
                      engine="spmd")
  state = sched.init(params, states)
  xs, ys = stacked(data)
  start = 0
  for n in (8, 3, 8, 1):
    chunk = tuple(np.concatenate([a[start:start + n], np.zeros_like(a[:8 - n])])
                  for a in (xs, ys))
    state, _ = sched.run(state, chunk, num_ticks=n)
    start += n
  assert sched.engine_impl.program(8)._cache_size() == 1
  for k in range(K):  # one padded vector per dtype per stage, on the stage's device
    flat = state["stages"][k]["flat"]
    assert sorted(flat) == ["bool", "float32", "int32", "uint32"]  # bool: ReLU masks
    assert {a.devices().pop() for a in flat.values()} == {jax.devices()[k]}
  # Every device holds a ring padded to the largest stage's (the last stage's too).
  ref = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05), devices=jax.devices()[:K])
  ref_state = ref.init(params, states, example_batch=data[0])
  ring = sum(a.nbytes for a in ref.stash(ref_state, 0))  # stage 0's D slots, unpadded
  spmd = sched.stash_bytes(state)
  assert 0 < ring + 4 * sched.ring_sizes[0] <= spmd[0]
  assert spmd[K - 1] == spmd[0] - 4 * sched.ring_sizes[0]  # the same ring, no batch indices


def test_spmd_engine_advances_two_states_alternately():
  """The engine reuses the mesh arrays its last call returned only for the state that call
  returned: two states advanced alternately by one SPMD schedule end as each does under the
  per-stage engine, and a state run twice in a row is assembled once."""
  K = 2
  stages, params, states = model("bn", K)
  data = batches(8)
  make = lambda **kw: fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05),
                                  devices=jax.devices()[:K], **kw)
  sched = make(engine="spmd")
  other = jax.tree.map(lambda a: 0.5 * a, params)
  a, b = sched.init(params, states), sched.init(other, states)
  engine, assembled = sched.engine_impl, []
  on_mesh = engine._on_mesh
  engine._on_mesh = lambda parts, spec: (
      assembled.append(isinstance(parts[0], dict)) or on_mesh(parts, spec))  # not batches
  xs, ys = stacked(data)
  for i in range(0, 6, 2):
    a, _ = sched.run(a, (xs[i:i + 2], ys[i:i + 2]))
    b, _ = sched.run(b, (xs[i:i + 2], ys[i:i + 2]))
  assert sum(assembled) == 6  # every call a state the last call did not return
  assembled.clear()
  for i in (6, 7):
    a, _ = sched.run(a, (xs[i:i + 1], ys[i:i + 1]))
    b, _ = sched.run(b, (xs[i:i + 1], ys[i:i + 1]))
  a, _ = sched.run(a, (xs[:1], ys[:1]))
  a, _ = sched.run(a, (xs[1:2], ys[1:2]))  # the state the last call returned: reused
  assert sum(assembled) == 5
  ref = make()
  for start, got, extra in ((params, a, data[:2]), (other, b, [])):
    r = ref.init(start, states)
    for batch in data + extra:
      r, _ = ref.step(r, batch)
    expected, actual = core_and_stash(ref, r), core_and_stash(sched, got)
    assert_trees_close(actual[0], expected[0], atol=1e-6)
    assert_trees_close(actual[1], expected[1], atol=1e-6)


def test_bad_engine_arguments():
  stages, _, _ = model("bn", 2)
  with pytest.raises(ValueError, match="engine"):
    fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), engine="pipelined")
  for make, match in (
      (lambda: fdg_jax.ddg(stages, loss_fn, optax.sgd(0.1), devices=jax.devices()[:2],
                           engine="spmd"), "read only the previous tick.s messages"),
      (lambda: fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), engine="spmd"), "distinct"),
      (lambda: fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), devices=jax.devices()[:2],
                           engine="spmd", telemetry=True), "telemetry")):
    with pytest.raises(ValueError, match=match):
      make()
  with pytest.raises(ValueError, match="one device"):
    fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), devices=jax.devices()[:2], engine="fused")
  with pytest.raises(ValueError, match="unknown gate"):
    fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), gate="sometimes")
  sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1))
  state = sched.init(*make_model("bn", 2)[1:])
  with pytest.raises(ValueError, match="num_ticks"):
    sched.run(state, stacked(batches(2)), num_ticks=3)


def test_convolutions_are_detected_for_the_default_loop():
  from fdg_jax import models, partition
  x = jnp.zeros((1, 8, 8, 1))
  for name, has_conv in (("cnn", True), ("mlp", False)):
    m = models.create(name, num_classes=10, input_shape=(8, 8, 1))
    stages = partition.split(m, 2, "uniform", example_input=x)
    params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
    sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1))
    sched.init(params, states, example_batch=(jnp.zeros((4, 8, 8, 1)), jnp.zeros(4, jnp.int32)))
    # XLA:CPU runs backward convolutions slowly inside a loop: one program per tick there.
    assert sched.scan == (not has_conv), name


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU default")
def test_default_gate_is_conditionals_for_small_fdg_ticks_on_cpu():
  """`Schedule.gate`: chained conditionals for FDG (stash) on CPU where every stage's
  training forward is at most COND_GATE_MAX_FLOPS (counted by XLA: 2 x batch x fan-in x
  fan-out per dense layer), masks for larger ticks, for DDG, for `recompute`, for
  convolutions, and where asked."""
  from fdg_jax import models, partition, schedules
  x = jnp.zeros((1, 8, 8, 1))

  def gate(name, widths=None, batch=32, algorithm="fdg", **kwargs):
    m = models.create(name, num_classes=10, input_shape=(8, 8, 1),
                      **({"widths": widths} if widths else {}))
    stages = partition.split(m, 4 if widths else 2, "uniform", example_input=x)
    params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
    sched = fdg_jax.create(algorithm, stages, loss_fn, optax.sgd(0.1), **kwargs)
    sched.init(params, states, example_batch=(jnp.zeros((batch, 8, 8, 1)),
                                              jnp.zeros(batch, jnp.int32)))
    return sched.gate, sched.forward_flops()

  g, flops = gate("mlp", [128] * 4)  # the quick start: 64 -> 4 x 128 -> 10, batch 32
  assert g == "cond"
  assert flops[1] == pytest.approx(2 * 32 * 128 * 128, rel=0.1)  # one 128 x 128 layer
  assert max(flops) <= schedules.COND_GATE_MAX_FLOPS
  g, flops = gate("mlp", [256] * 4)
  assert g == "mask" and max(flops) > schedules.COND_GATE_MAX_FLOPS
  assert gate("mlp", [128] * 4, algorithm="ddg")[0] == "mask"
  assert gate("mlp", [128] * 4, backward="recompute")[0] == "mask"
  assert gate("mlp", [128] * 4, gate="mask")[0] == "mask"
  assert gate("mlp", [256] * 4, gate="cond")[0] == "cond"
  assert gate("cnn")[0] == "mask"


@pytest.mark.parametrize("options, heads", [(None, None), ({}, None), ({}, False)])
def test_per_stage_engine_keeps_flat_rings_updated_in_place(options, heads):
  """A stage call carries a few buffers whatever the model, and XLA updates the ring in
  place: no copy of a ring-sized buffer in the compiled call, with XLA:CPU's region analysis
  (the default on CPU: no head) or with the ring's head (XLA's own options). With neither,
  a call that reads its slot before the write copies the ring twice."""
  import re
  from fdg_jax import models, partition, schedules
  K = 2
  x = jnp.zeros((1, 16, 16, 3))
  m = models.create("cnn", num_classes=10, input_shape=(16, 16, 3))
  stages = partition.split(m, K, "uniform", example_input=x)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
  batch = (jnp.ones((8, 16, 16, 3)), jnp.zeros(8, jnp.int32))
  kwargs = {"compiler_options": options, "ring_heads": heads}
  flat = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), devices=jax.devices()[:K], **kwargs)
  on_cpu = jax.default_backend() == "cpu"
  assert flat.ring_heads == (heads is not False and not (on_cpu and options is None))
  state = flat.init(params, states, example_batch=batch)
  stash = state["stages"][0]["stash"]
  assert sorted(stash) == ["head", "ring"][not flat.ring_heads:]
  assert len(jax.tree.leaves(stash)) <= 4
  D, extra = flat.ring_sizes[0], int(flat.ring_heads)
  leaves = flat.stash(state, 0)
  assert len(leaves) > 4 and all(a.shape[0] == D for a in leaves)
  slot = sum(a.nbytes for a in leaves) // D
  assert flat.stash_bytes(state)[0] == (D + extra) * slot + 4 * D  # the ring (and head)
  fused = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), **kwargs)
  fused_state = fused.init(params, states, example_batch=batch)
  assert len(jax.tree.leaves(fused_state["stages"][0]["stash"])) <= 4
  assert fused.stash_bytes(fused_state)[0] == (D + extra) * slot + 4 * D
  for _ in range(3):
    state, _ = flat.step(state, batch)
  call = flat.engine_impl.stage_call(0, True, True)
  packed = state["stages"][0]
  (rest,), apart = fdg_jax.ring.without_heads([packed])
  hlo = call.jitted.lower(rest, apart, batch, state["inbox"][0]["cot"]).compile().as_text()
  sizes = {str(a.size) for a in packed["stash"]["ring"].values()}
  copies = [n for n in re.findall(r"= \w+\[(\d+)\]\{0\} copy\(", hlo) if n in sizes]
  if heads is False and on_cpu:  # neither: XLA:CPU's default copies the ring, twice
    assert len(copies) == 2, copies
  else:
    assert not copies, copies


def _loop_body_copies(hlo: str) -> list[str]:
  """The types (e.g. f32[8,16]) of the copy instructions in the body of the (one) device
  loop of a compiled program."""
  import re
  body = re.search(r"while\(.*?body=%?([\w.\-]+)", hlo).group(1)
  comp = re.search(r"\n%?" + re.escape(body) + r" [^\n]*\{\n(.*?)\n\}", hlo, re.S).group(1)
  return [t.split("{")[0] for t in re.findall(r"= (\S+) copy\(", comp)]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA:CPU option")
def test_fused_loop_carries_a_tick_state_without_copies_on_cpu():
  """FDG's fused `run` loop carries every stage's state and messages; the old and new
  versions of each are live within a tick. XLA:CPU's default copy insertion copies each of
  them every iteration; the schedule's default options (region analysis) leave none with
  masks, and with chained conditionals (the default gate here) only message-sized ones, at
  most one per message (a cotangent made before the one it replaces is read)."""
  K = 4
  stages, params, states = model("mlp", K)
  data = batches(8)
  copies = {}
  for name, options, gate in (("mask", None, "mask"), ("xla", {}, "mask"),
                              ("cond", None, None)):
    sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.05, momentum=0.9),
                        compiler_options=options, gate=gate)
    state = sched.init(params, states, example_batch=data[0])
    xs, ys = stacked(data)
    state, _ = sched.run(state, (xs, ys))
    assert sched.gate == (gate or "cond")
    (rest, heads) = fdg_jax.ring.without_heads(state["stages"])
    lowered = sched.engine_impl.program(len(data)).jitted.lower(
        rest, heads, state["inbox"], xs, ys, np.int32(0), np.int32(len(data)))
    copies[name] = _loop_body_copies(lowered.compile().as_text())
  assert sched.compiler_options == {"xla_cpu_copy_insertion_use_region_analysis": True}
  assert copies["mask"] == [], copies
  assert len(copies["xla"]) > 0, f"XLA:CPU no longer copies loop state by default: {copies}"
  messages = {f"{a.dtype.name.replace('float', 'f').replace('int', 's')}{list(a.shape)}"
              .replace(" ", "") for a in jax.tree.leaves(state["inbox"])}
  assert set(copies["cond"]) <= messages, (copies["cond"], messages)
  assert len(copies["cond"]) <= len(jax.tree.leaves(state["inbox"])), copies


def test_switch_returns_what_its_branches_pass_on_from_outside_the_conditional():
  """`engines.switch` leaves out of the conditional an output every branch whose part is
  used returns unchanged from an operand or as an earlier output; the values are those of
  `lax.switch` where used."""
  from fdg_jax.engines.fused_ops import switch as _switch
  x, y = jnp.arange(3.0), jnp.arange(3.0) + 10
  branches = [lambda x, y: (x, jnp.zeros(3), y),            # part 1 unused here
              lambda x, y: (x, 2 * y, y),
              lambda x, y: (x, x, y)]
  used = [(True, False, True), (True, True, True), (True, True, True)]

  def check(index):
    seen = {}

    def f(x, y, index):
      out = _switch(index, branches, (x, y), used)
      seen["x passed"] = out[0] is x  # left out: every branch passes x on
      seen["y passed"] = out[2] is y
      return out
    out = jax.jit(f)(x, y, index)
    ref = jax.lax.switch(index, branches, x, y)
    for got, want, part in zip(out, ref, range(3)):
      if used[index][part]:
        np.testing.assert_array_equal(got, want)
    return seen

  assert check(1) == {"x passed": True, "y passed": True}
  check(0)
  check(2)
  # A value returned twice leaves the conditional once; an operand a used branch changes
  # stays in it.
  twice = [lambda x, y: (lambda z: (z, z))(x + 1), lambda x, y: (y, y)]
  seen = {}

  def g(x, y, index):
    out = _switch(index, twice, (x, y), [(True, True), (True, True)])
    seen["second is first"] = out[1] is out[0]
    return out
  for i, want in ((0, x + 1), (1, y)):
    a, b = jax.jit(g)(x, y, i)
    np.testing.assert_array_equal(a, want)
    np.testing.assert_array_equal(b, want)
  assert seen["second is first"]


def test_always_true_is_true_for_any_value_and_not_folded():
  """The chain of `_GatedOps` rests on a test XLA cannot prove: were it folded, the stages
  would no longer be ordered (their results would not change: only their speed)."""
  from fdg_jax.engines.fused_ops import always_true as _always_true
  values = [np.float32(np.nan), np.float32(-np.inf), np.float32(-0.0), np.float16(-1),
            np.int32(np.iinfo(np.int32).min), np.int32(0), np.bool_(False),
            jnp.bfloat16(-3.0)]
  for v in values:
    assert bool(jax.jit(_always_true)(jnp.asarray([v]))), v
  assert bool(jax.jit(_always_true)(jax.random.split(jax.random.key(0), 3)))  # typed keys
  text = jax.jit(lambda x, a, b: jnp.where(_always_true(x), a, b)).lower(
      jnp.zeros(2), jnp.ones(3), jnp.zeros(3)).compile().as_text()
  assert "select" in text


def per_replica(apply, R):
  """`apply` over R equal parts of the batch, each with its own BatchNorm statistics and
  dropout key (the stage's key folded with the part's index), the new model states
  averaged: data-parallel training without synchronised layers, written on one device."""
  def wrapped(params, model_state, x, *, train=True, rng=None):
    outs, states = [], []
    for r, part in enumerate(jnp.split(x, R)):
      key = None if rng is None else jax.random.fold_in(rng, r)
      out, new = apply(params, model_state, part, train=train, rng=key)
      outs.append(out)
      states.append(new)
    return jnp.concatenate(outs), jax.tree.map(lambda *a: sum(a) / R, *states)
  return wrapped


@pytest.mark.parametrize("kind,beta,backward,optimizer", [
    ("mlp", 0.5, "stash", "sgd"),
    ("bn", 1.0, "stash", "adam"),
    ("dropout", 1.0, "recompute", "sgd"),
])
def test_spmd_engine_over_replicas_equals_per_replica_reference(kind, beta, backward,
                                                                 optimizer):
  """An (R, K) = (2, 2) mesh under the SPMD engine: each replica's stage work on its half of
  the batch, gradients, statistics and metrics averaged. Reference: the per-stage engine
  with every stage run on the halves of the global batch (`per_replica`). Without
  batch-coupled layers the SPMD engine also equals the per-stage engine on the same mesh,
  stash included; with BatchNorm it differs from it (statistics per replica)."""
  K, R = 2, 2
  stages, params, states = model(kind, K)
  data = batches(11)
  opt = (optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.05, momentum=0.9))
         if optimizer == "sgd" else optax.adam(1e-2))
  make = lambda st, **kw: fdg_jax.fdg(st, loss_fn, opt, beta=beta, backward=backward, **kw)

  def losses_of(sched):
    state, out = sched.init(params, states), []
    for b in data:
      state, m = sched.step(state, b)
      out.append(float(m["loss"]) if "loss" in m else None)
    return state, out

  halves = [fdg_jax.Stage(apply=per_replica(s.apply, R)) for s in stages]
  ref = make(halves, devices=jax.devices()[:K])
  ref_state, ref_losses = losses_of(ref)
  ref_trace = by_steps(ref, params, states, data)[1]

  sched = make(stages, mesh=make_mesh(R, K), engine="spmd")
  state, trace, losses = by_steps_and_runs(sched, params, states, data, (4, 1, 6))
  assert trace == ref_trace
  assert losses == pytest.approx(ref_losses, abs=1e-6)
  for k in range(K):
    assert_trees_close(jax.device_get(sched.stage_state(state, k)),
                       jax.device_get(ref.stage_state(ref_state, k)), atol=1e-6)
    # Every replica keeps the same copy of its stage's core state, bit for bit.
    cores = sched.engine_impl.vectors.layouts()[1]["core"]
    for name, vector in state["stages"][k]["flat"].items():
      if name in cores:
        rows = np.asarray(vector).reshape(R, -1)[:, :cores[name]]
        np.testing.assert_array_equal(rows[0], rows[1])
  # Each replica's BatchNorm statistics (or dropout masks) are its own: the per-stage engine
  # on the same mesh, which sees the global batch, differs; without them it agrees, stash
  # included.
  gspmd = make(stages, mesh=make_mesh(R, K))
  gspmd_state, gspmd_losses = losses_of(gspmd)
  if kind == "mlp":
    assert gspmd_losses == pytest.approx(losses, abs=1e-6)
    for k in range(K):
      assert_trees_close(jax.device_get(sched.stash(state, k)),
                         jax.device_get(gspmd.stash(gspmd_state, k)), atol=1e-6)
  else:
    assert max(abs(a - b) for a, b in zip(gspmd_losses[1:], losses[1:])) > 1e-3
  final = sched.params(state)
  for k in range(K):  # non-vacuous: every stage trained
    assert not np.allclose(np.asarray(final[k]["w"]), np.asarray(params[k]["w"]))
