"""PipeDream (asynchronous, weight stashing) as a built-in schedule, against an independent
reference: its update equation written out with the unsplit model and `jax.grad`."""

import jax
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax import engines, plans
from test_schedules import OPTIMIZERS, run_schedule, stages_of
from toy_models import assert_trees_close, batches, loss_fn, make_model


def pipedream_reference(applies, params, states, opt, data, backward="stash"):
  """PipeDream's update, with no schedule: at tick t every stage applies the gradient of
  batch b = t-(K-1). Stage j < K-1 forwarded b at tick b+j, after that tick's update; the
  last stage forwards it at tick t, before its update. The backward runs down the stages at
  the weights each forward ran with ("stash") or at the stage's weights before tick t's
  update ("recompute"), on the inputs the forwards computed. Returns (params, per tick the
  batch whose gradient each stage applied)."""
  K = len(applies)
  theta = list(params)
  opt_states = [opt.init(p) for p in theta]
  forwarded_at = {}  # (stage, batch) -> the weights stage forwarded batch at
  trace = []

  def apply(j, p, h):
    return applies[j](p, states[j], h, train=True)[0]

  for t in range(len(data)):
    b = t - (K - 1)
    row = [None] * K
    if b >= 0:
      x, y = data[b]
      fw = [forwarded_at.pop((j, b)) for j in range(K - 1)] + [theta[K - 1]]
      at = fw if backward == "stash" else list(theta)
      xs = [x]
      for j in range(K - 1):
        xs.append(apply(j, fw[j], xs[j]))
      grads = [None] * K
      grads[K - 1], cot = jax.grad(lambda p, h: loss_fn(apply(K - 1, p, h), y),
                                   argnums=(0, 1))(at[K - 1], xs[K - 1])
      for j in reversed(range(K - 1)):
        _, vjp = jax.vjp(lambda p, h, j=j: apply(j, p, h), at[j], xs[j])
        grads[j], cot = vjp(cot)
      for k in range(K):
        upd, opt_states[k] = opt.update(grads[k], opt_states[k], theta[k])
        theta[k] = optax.apply_updates(theta[k], upd)
        row[k] = b
    for k in range(K - 1):
      if t - k >= 0:
        forwarded_at[(k, t - k)] = theta[k]
    trace.append(row)
  return theta, trace


@pytest.mark.parametrize("K,optimizer,backward,engine,path", [
    (1, "adam", "stash", "fused", "step"),
    (2, "sgd_momentum", "stash", "fused", "step"),
    (3, "adam", "recompute", "fused", "run"),
    (4, "sgd_momentum", "stash", "per_stage", "run"),
    (4, "adam", "stash", "fused", "step"),
    (4, "sgd_momentum", "recompute", "per_stage", "step"),
])
def test_pipedream_matches_its_update_equation(K, optimizer, backward, engine, path):
  applies, params, states = make_model("mlp", K)  # no model state
  data = batches(12)
  ref_params, ref_trace = pipedream_reference(applies, params, states,
                                              OPTIMIZERS[optimizer](), data, backward)
  sched = fdg_jax.create("pipedream", stages_of(applies), loss_fn, OPTIMIZERS[optimizer](),
                         backward=backward, engine=engine)
  got, _, trace, _ = run_schedule(sched, params, states, data,
                                  chunks=(5, 7) if path == "run" else None)
  assert trace == ref_trace
  assert_trees_close(got, ref_params, atol=1e-5)
  for k in range(K):  # every stage trained (else the equality would say little)
    assert not np.allclose(np.asarray(got[k]["w"]), np.asarray(params[k]["w"]))


def test_pipedream_is_declared_with_its_delays():
  sp = plans.spec("pipedream")
  assert sp.delayed and engines.plan_refusal("spmd", plans.plan("pipedream", 4))
  for K in (1, 2, 4):
    assert [fdg_jax.delay("pipedream", k, K) for k in range(K)] == [K - 1 - k for k in range(K)]
  assert plans.plan("pipedream", 4).ring_sizes == (3, 2, 1, 0)


def test_pipedream_replicas_follow_the_same_equation():
  """Two data-parallel replicas of each stage (mesh data=2 x stage=2), fed the shards of the
  batches, train as the equation does on the whole batches."""
  from fdg_jax import runtime
  K = 2
  applies, params, states = make_model("mlp", K)
  data = batches(9)
  opt = OPTIMIZERS["sgd_momentum"]
  ref_params, ref_trace = pipedream_reference(applies, params, states, opt(), data)
  sched = fdg_jax.create("pipedream", stages_of(applies), loss_fn, opt(),
                         mesh=runtime.make_mesh(2, K))
  got, _, trace, _ = run_schedule(sched, params, states, data)
  assert trace == ref_trace
  assert_trees_close(got, ref_params, atol=1e-5)
