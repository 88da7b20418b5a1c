"""Staleness methods inside the schedules, and the staleness telemetry, against the
plain-Python reference simulator of test_schedules (which calls each stage's forward hook
right before that stage's forward, and measures the telemetry from its own lists)."""

import jax
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax import staleness
from fdg_jax.delays import delay
from simulator import simulate
from test_schedules import run_schedule, stages_of
from toy_models import assert_trees_close, batches, loss_fn, make_model

HPARAMS = {"lr_by_delay": {"ramp_steps": 6}, "dc": {"lam": 2.0}, "weight_prediction": {},
           "spike_compensation": {}, "nesterov_delay": {"gamma": 0.9}, "none": {}}


def stage_opts(method, algorithm, K, lr=0.05, momentum=0.9):
  base = optax.sgd(lr, momentum=momentum)
  return [staleness.stage_optimizer(method, base, delay=delay(algorithm, k, K),
                                    learning_rate=lr, momentum=momentum, weight_decay=0.0,
                                    hparams=HPARAMS[method])
          for k in range(K)]


CASES = [("weight_prediction", "fdg", "stash", "step"),
         ("weight_prediction", "ddg", "recompute", "run"),
         ("dc", "fdg", "stash", "run"), ("dc", "ddg", "stash", "step"),
         ("nesterov_delay", "fdg", "recompute", "step"), ("nesterov_delay", "ddg", "stash", "run"),
         ("spike_compensation", "fdg", "stash", "run"), ("lr_by_delay", "fdg", "recompute", "step")]


@pytest.mark.parametrize("method,algorithm,backward,path", CASES)
def test_methods_in_the_schedule_match_the_reference(method, algorithm, backward, path):
  K = 3
  applies, params, states = make_model("mlp", K)
  data = batches(13)
  beta = 0.5 if algorithm == "fdg" and method != "dc" else 1.0
  ref_params, _, ref_trace = simulate(algorithm, applies, params, states,
                                      stage_opts(method, algorithm, K), data, beta=beta,
                                      backward=backward)
  kwargs = {"beta": beta} if algorithm == "fdg" else {}
  sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn,
                         stage_opts(method, algorithm, K), backward=backward, **kwargs)
  got, _, trace, _ = run_schedule(sched, params, states, data,
                                  chunks=(5, 8) if path == "run" else None)
  assert trace == ref_trace
  assert_trees_close(got, ref_params, atol=1e-5)
  # ... and the method changed the training (else the equality could hide an ignored hook).
  plain, _, _, _ = run_schedule(
      fdg_jax.create(algorithm, stages_of(applies), loss_fn, optax.sgd(0.05, momentum=0.9),
                     backward=backward, **kwargs), params, states, data)
  assert not np.allclose(np.asarray(got[0]["w"]), np.asarray(plain[0]["w"]), atol=1e-6)


def test_an_optimizer_factory_of_stage_and_delay():
  K = 3
  applies, params, states = make_model("mlp", K)
  data = batches(9)
  seen = []

  def factory(k, d):
    seen.append((k, d))
    return staleness.stage_optimizer("weight_prediction", optax.sgd(0.05, momentum=0.9),
                                     delay=d, learning_rate=0.05, momentum=0.9,
                                     weight_decay=0.0)

  a = run_schedule(fdg_jax.fdg(stages_of(applies), loss_fn, factory), params, states, data)[0]
  b = run_schedule(fdg_jax.fdg(stages_of(applies), loss_fn, stage_opts(
      "weight_prediction", "fdg", K)), params, states, data)[0]
  assert seen == [(0, 4), (1, 2), (2, 0)]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("algorithm,backward,engine", [("fdg", "stash", "fused"),
                                                       ("fdg", "recompute", "per_stage"),
                                                       ("ddg", "stash", "per_stage")])
def test_telemetry_matches_the_reference(algorithm, backward, engine):
  K = 3
  applies, params, states = make_model("mlp", K)
  data = batches(12)
  probe_ticks = (2, 5, 9, 11)
  method = "weight_prediction"
  *_, probes = simulate(algorithm, applies, params, states, stage_opts(method, algorithm, K),
                        data, backward=backward, probe_ticks=probe_ticks)
  devices = jax.devices()[:K] if engine == "per_stage" else None
  sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn,
                         stage_opts(method, algorithm, K), backward=backward,
                         devices=devices, engine=engine, telemetry=True)
  plain = fdg_jax.create(algorithm, stages_of(applies), loss_fn,
                         stage_opts(method, algorithm, K), backward=backward)
  state, plain_state = sched.init(params, states), plain.init(params, states)
  checked = 0
  for t, b in enumerate(data):
    if t in probe_ticks:
      got = sched.telemetry(state)
      want_disc, want_cos = probes[t]
      for k in range(K):
        assert (got["weight_discrepancy"][k] is None) == (want_disc[k] is None), (t, k)
        assert (got["grad_cosine"][k] is None) == (want_cos[k] is None), (t, k)
        if want_disc[k] is not None:
          np.testing.assert_allclose(got["weight_discrepancy"][k], want_disc[k], rtol=1e-4,
                                     atol=1e-7)
          np.testing.assert_allclose(got["grad_cosine"][k], want_cos[k], rtol=1e-4, atol=1e-5)
          checked += 1
    state, _ = sched.step(state, b)
    plain_state, _ = plain.step(plain_state, b)
  assert checked >= 4
  # A stale stage's gradient is measurably stale (otherwise the comparison says little).
  assert any(0 < c < 0.9999 for _, cs in probes.values() for c in cs if c is not None)
  # Telemetry leaves the training bitwise unchanged.
  for x, y in zip(jax.tree.leaves(sched.params(state)), jax.tree.leaves(plain.params(plain_state))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_telemetry_needs_the_flag_and_is_none_without_staleness():
  applies, params, states = make_model("mlp", 2)
  sched = fdg_jax.create("bp", stages_of(applies), loss_fn, optax.sgd(0.1), telemetry=True)
  state = sched.init(params, states)
  for b in batches(3):
    state, _ = sched.step(state, b)
  assert sched.telemetry(state) == {"weight_discrepancy": [None, None],
                                    "grad_cosine": [None, None]}
  off = fdg_jax.create("fdg", stages_of(applies), loss_fn, optax.sgd(0.1))
  with pytest.raises(ValueError, match="telemetry=True"):
    off.telemetry(off.init(params, states))


@pytest.mark.parametrize("path", ["step", "run"])
def test_shrinking_at_the_update_is_a_per_stage_learning_rate_scale(path):
  """FDG's beta with shrink_at="update": stage k's update times beta**(K-1-k), against the
  simulator running beta 1 with that scale chained after each stage's Adam."""
  K, beta = 3, 0.5
  applies, params, states = make_model("mlp", K)
  data = batches(13)
  scaled = [optax.chain(optax.adam(1e-2), optax.scale(beta ** (K - 1 - k))) for k in range(K)]
  ref_params, _, ref_trace = simulate("fdg", applies, params, states, scaled, data, beta=1.0)
  sched = fdg_jax.fdg(stages_of(applies), loss_fn, optax.adam(1e-2), beta=beta,
                      shrink_at="update")
  got, _, trace, _ = run_schedule(sched, params, states, data,
                                  chunks=(5, 8) if path == "run" else None)
  assert trace == ref_trace
  assert_trees_close(got, ref_params, atol=1e-6)
  # Under Adam, shrinking the gradient changes (almost) nothing; shrinking the update does.
  grad, _, _, _ = run_schedule(fdg_jax.fdg(stages_of(applies), loss_fn, optax.adam(1e-2),
                                           beta=beta), params, states, data)
  plain, _, _, _ = run_schedule(fdg_jax.fdg(stages_of(applies), loss_fn, optax.adam(1e-2)),
                                params, states, data)
  assert_trees_close(grad, plain, atol=1e-4)
  assert not np.allclose(np.asarray(got[0]["w"]), np.asarray(plain[0]["w"]), atol=1e-4)
  with pytest.raises(ValueError, match="shrink_at is an option of fdg "):
    fdg_jax.create("ddg", stages_of(applies), loss_fn, optax.adam(1e-2), shrink_at="update")
