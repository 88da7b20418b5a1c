"""The BP, DDG and FDG schedules against independent references.

The reference simulator (`simulator.simulate`) is a literal, eager transcription of
docs/algorithms.md that shares no code with the library; BP is also checked against the unsplit
model.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fdg_jax
from simulator import simulate  # noqa: F401 (also imported from here by other tests)
from toy_models import assert_trees_close, batches, loss_fn, make_model


def run_schedule(schedule, params, states, data, chunks=None):
  """Ticks over `data` by `step`, or by `run` over consecutive chunks of the given lengths."""
  state = schedule.init(params, states)
  trace = []
  if chunks is None:
    for b in data:
      state, m = schedule.step(state, b)
      trace.append([None if u is None else int(u) for u in m["updated"]])
  else:
    xs = np.stack([np.asarray(x) for x, _ in data])
    ys = np.stack([np.asarray(y) for _, y in data])
    start = 0
    for n in chunks:
      state, m = schedule.run(state, (xs[start:start + n], ys[start:start + n]))
      trace += [[None if u < 0 else int(u) for u in row] for row in np.asarray(m["updated"])]
      start += n
    assert start == len(data)
  return schedule.params(state), schedule.model_states(state), trace, state


def stages_of(applies):
  return [fdg_jax.Stage(apply=a) for a in applies]


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.chain(optax.add_decayed_weights(5e-3),
                                        optax.sgd(0.05, momentum=0.9)),
    "adam": lambda: optax.adam(1e-2),
}


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("K", [2, 3, 4])
def test_bp_equals_unsplit_model(K):
  """One BP tick: the loss and every stage's gradient equal those of the unsplit model."""
  applies, params, states = make_model("bn", K)
  (x, y), = batches(1)

  def unsplit_loss(ps):
    h = x
    for k in range(K):
      h, _ = applies[k](ps[k], states[k], h, train=True)
    return loss_fn(h, y)

  ref_loss, ref_grads = jax.value_and_grad(unsplit_loss)(params)
  # An "optimizer" that applies nothing and keeps the gradient it was given as its state.
  capture = optax.GradientTransformation(
      lambda p: jax.tree.map(jnp.zeros_like, p),
      lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))
  sched = fdg_jax.bp(stages_of(applies), loss_fn, capture)
  state, m = sched.step(sched.init(params, states), (x, y))
  np.testing.assert_allclose(float(m["loss"]), float(ref_loss), atol=1e-6, rtol=0)
  for k in range(K):
    assert_trees_close(sched.stage_state(state, k)["opt_state"], ref_grads[k], atol=1e-6)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_single_stage_ddg_fdg_are_bitwise_bp(optimizer):
  applies, params, states = make_model("bn", 1)
  data = batches(10)
  results = {}
  for alg in fdg_jax.ALGORITHMS:
    sched = fdg_jax.create(alg, stages_of(applies), loss_fn, OPTIMIZERS[optimizer]())
    results[alg] = run_schedule(sched, params, states, data)[0]
  for alg in ("ddg", "fdg"):
    for a, b in zip(jax.tree.leaves(results[alg]), jax.tree.leaves(results["bp"])):
      assert np.array_equal(np.asarray(a), np.asarray(b)), alg


def _reference_cases():
  """K x (algorithm, beta) x backward, each run with both optimizers and both models.

  Every (K, algorithm, beta, backward) runs twice: SGD+momentum with one model and Adam with
  the other, the pairing alternating so each optimizer meets each model. FDG_FULL_GRID=1
  runs the full product (72 cases) instead of this covering set (36). Each case runs on
  one device (the fused engine) through `step`, or through `run` in chunks of 5 and 8
  ticks, alternating (FDG_FULL_GRID: both).
  """
  full = os.environ.get("FDG_FULL_GRID") == "1"
  cases, i = [], 0
  for K in (2, 3, 4):
    for algorithm, beta in (("ddg", 1.0), ("fdg", 1.0), ("fdg", 0.5)):
      for backward in ("stash", "recompute"):
        if full:
          cases += [(K, algorithm, beta, o, backward, m, path)
                    for o in ("sgd_momentum", "adam") for m in ("mlp", "bn")
                    for path in ("step", "run")]
        else:
          models = ("mlp", "bn") if i % 2 == 0 else ("bn", "mlp")
          paths = ("step", "run") if i % 2 == 0 else ("run", "step")
          cases += [(K, algorithm, beta, "sgd_momentum", backward, models[0], paths[0]),
                    (K, algorithm, beta, "adam", backward, models[1], paths[1])]
        i += 1
  return cases


@pytest.mark.parametrize("K,algorithm,beta,optimizer,backward,model,path", _reference_cases())
def test_matches_reference_simulator(K, algorithm, beta, optimizer, backward, model, path):
  applies, params, states = make_model(model, K)
  data = batches(13)
  ref_params, ref_states, ref_trace = simulate(
      algorithm, applies, params, states, OPTIMIZERS[optimizer](), data, beta=beta,
      backward=backward)
  kwargs = {"beta": beta} if algorithm == "fdg" else {}
  sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn, OPTIMIZERS[optimizer](),
                         backward=backward, **kwargs)
  got_params, got_states, trace, _ = run_schedule(sched, params, states, data,
                                                  chunks=(5, 8) if path == "run" else None)
  assert trace == ref_trace
  assert_trees_close(got_params, ref_params, atol=1e-5)
  assert_trees_close(got_states, ref_states, atol=1e-5)
  # The run must have trained every stage (otherwise equality above would be vacuous).
  for k in range(K):
    assert not np.allclose(np.asarray(got_params[k]["w"]), np.asarray(params[k]["w"]))


@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_delays_and_warm_up(algorithm, K):
  """Stage k applies at tick t the gradient of the batch it forwarded d_k ticks earlier."""
  applies, params, states = make_model("mlp", K)
  sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn, optax.sgd(0.01))
  _, _, trace, _ = run_schedule(sched, params, states, batches(3 * K + 3))
  for k in range(K):
    d = {"bp": 0, "ddg": K - 1 - k, "fdg": 2 * (K - 1 - k)}[algorithm]
    assert sched.delays[k] == d
    # Stage k forwards batch b at tick b (BP, DDG) or b + k (FDG).
    lag = d + (k if algorithm == "fdg" else 0)
    for t, updated in enumerate(trace):
      expected = t - lag if t >= lag else None
      assert updated[k] == expected, (k, t, updated)


def test_warm_up_leaves_params_and_optimizer_untouched():
  K = 3
  applies, params, states = make_model("bn", K)
  sched = fdg_jax.fdg(stages_of(applies), loss_fn, optax.adam(1e-2))
  state = sched.init(params, states)
  initial = [jax.tree.map(np.asarray, (s["params"], s["opt_state"]))
             for s in (sched.stage_state(state, k) for k in range(K))]
  for t, b in enumerate(batches(2 * K)):
    state, _ = sched.step(state, b)
    for k in range(K):
      first_update = 2 * (K - 1) - k
      s = sched.stage_state(state, k)
      now = jax.tree.map(np.asarray, (s["params"], s["opt_state"]))
      same = all(np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(now), jax.tree.leaves(initial[k])))
      assert same == (t < first_update), (k, t)


@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
def test_stages_on_separate_devices_equal_one_device(algorithm):
  K = 4
  assert len(jax.devices()) >= K
  applies, params, states = make_model("bn", K)
  data = batches(10)
  results = []
  for devices in (None, jax.devices()[:K]):
    sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn, optax.sgd(0.05, 0.9),
                           devices=devices)
    got, _, _, state = run_schedule(sched, params, states, data)
    results.append(got)
    if devices is not None:
      for k in range(K):
        for leaf in jax.tree.leaves(state["stages"][k]):
          assert leaf.devices() == {devices[k]}
  for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backward", ["stash", "recompute"])
@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
def test_steady_state_does_not_retrace(algorithm, backward):
  K = 3
  applies, params, states = make_model("bn", K)
  sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn, optax.sgd(0.05, 0.9),
                         backward=backward, devices=jax.devices()[:K])
  state = sched.init(params, states)
  data = batches(4 * K)
  for b in data[:2 * K]:  # past the warm-up: every variant has been compiled once
    state, _ = sched.step(state, b)
  sizes = {key: fn._cache_size() for key, fn in sched.engine_impl.fns.items()}
  assert all(v == 1 for v in sizes.values()), sizes
  for b in data[2 * K:]:
    state, _ = sched.step(state, b)
  assert {key: fn._cache_size() for key, fn in sched.engine_impl.fns.items()} == sizes


def test_evaluate_is_the_unsplit_eval_forward():
  K = 3
  applies, params, states = make_model("bn", K)
  sched = fdg_jax.fdg(stages_of(applies), loss_fn, optax.sgd(0.05), devices=jax.devices()[:K])
  state = sched.init(params, states)
  for b in batches(6):
    state, _ = sched.step(state, b)
  x = batches(1, seed=7)[0][0]
  ps, ss = jax.device_get((sched.params(state), sched.model_states(state)))
  expected = x
  for k in range(K):
    expected, _ = applies[k](ps[k], ss[k], expected, train=False)
  np.testing.assert_allclose(np.asarray(sched.evaluate(state, x)), np.asarray(expected),
                             atol=1e-6)
  np.testing.assert_allclose(
      np.asarray(fdg_jax.forward(stages_of(applies), ps, ss, x, train=False)[0]),
      np.asarray(expected), atol=1e-6)


def test_stash_sizes_follow_the_ring_lengths():
  K = 4
  applies, params, states = make_model("mlp", K)
  (x, y), = batches(1)
  for heads in (False, True):
    sizes = {}
    for backward in ("stash", "recompute"):
      sched = fdg_jax.fdg(stages_of(applies), loss_fn, optax.sgd(0.1), backward=backward,
                          ring_heads=heads)
      state = sched.init(params, states, example_batch=(x, y))
      sizes[backward] = sched.stash_bytes(state)
      assert sched.ring_sizes == (6, 4, 2, 0)
    # recompute keeps the input (8x6 float32) per slot, plus the int32 batch index of the
    # slot (from which the forward's RNG key is rebuilt); a head is one more input.
    per_slot, head = 8 * 6 * 4 + 4, 8 * 6 * 4 * heads
    assert sizes["recompute"] == [6 * per_slot + head, 4 * per_slot + head,
                                  2 * per_slot + head, 0]
    # stash keeps vjp residuals: at least the input, and the weights it used.
    assert all(s > r for s, r in zip(sizes["stash"][:3], sizes["recompute"][:3]))
    assert sizes["stash"][3] == 0


def test_bad_arguments_are_rejected():
  applies, params, states = make_model("mlp", 2)
  stages = stages_of(applies)
  with pytest.raises(ValueError, match="beta"):
    fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), beta=0.0)
  with pytest.raises(ValueError, match="algorithm"):
    fdg_jax.create("zero_bubble", stages, loss_fn, optax.sgd(0.1))
  with pytest.raises(ValueError, match="backward"):
    fdg_jax.ddg(stages, loss_fn, optax.sgd(0.1), backward="nope")
  with pytest.raises(ValueError, match="devices"):
    fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), devices=jax.devices()[:3])
  with pytest.raises(ValueError, match="optimizers"):
    fdg_jax.fdg(stages, loss_fn, [optax.sgd(0.1)] * 3)
