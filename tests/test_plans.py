"""Schedules as data: the plans' derived delays, rings and warm-up against docs/algorithms.md's
closed forms; a plan of one's own against an independent reference; GPipe and 1F1B against
BP (one device and K), their per-device orders and stash peaks."""

import jax
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax import plans
from fdg_jax.plans import Call, Plan
from toy_models import assert_trees_close, batches, loss_fn, make_model


# ------------------------------------------------------------------------------ BP, DDG, FDG
def closed_form(name, K):
  """docs/algorithms.md: delays, ring sizes, first forward and first backward tick per stage."""
  d = [K - 1 - k for k in range(K)]
  if name == "bp":
    return [0] * K, [1] * (K - 1) + [0], [0] * K, [0] * K
  if name == "ddg":
    return d, [K - k for k in range(K - 1)] + [0], [0] * K, d
  fdg = [2 * x for x in d]
  return fdg, fdg, list(range(K)), [k + fdg[k] for k in range(K - 1)] + [K - 1]


@pytest.mark.parametrize("name", ["bp", "ddg", "fdg"])
@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_plans_imply_the_papers_delays_rings_and_warm_up(name, K):
  p = plans.plan(name, K)
  delays, rings, first_f, first_b = closed_form(name, K)
  if K == 1:
    rings = [0]
  assert list(p.delays) == delays and list(p.ring_sizes) == rings
  for k in range(K):
    for t in range(4 * K + 2):
      fwd, bwd = p.flags(k, t)
      assert fwd == (t >= first_f[k]), (k, t)
      if k < K - 1:
        assert bwd == (t >= first_b[k]), (k, t)
  assert p.fill_ticks == {"bp": 0, "ddg": K - 1, "fdg": 2 * (K - 1)}[name]
  assert p.decoupled == (name == "fdg" or K == 1)  # one stage: nothing is sent


def test_the_grid_prints_each_stage_s_work_per_tick():
  rows = [[cell.strip() for cell in row.split("|")[1:]]
          for row in plans.plan("fdg", 3).grid(6).splitlines()[2:]]
  assert rows[0] == ["F0", ".", "."]
  assert rows[2] == ["F2", "F1", "F0 B0"]     # the last stage: loss and backward of batch 0
  assert rows[4] == ["F4 B0", "F3 B1", "F2 B2"]  # stage 0 applies batch 0 at 2(K-1) = 4


@pytest.mark.parametrize("calls,match", [
    ((Call(0, True, False, "batch", None), Call(1, True, True, "now", None),
      Call(0, False, True, None, "inbox")), None),
    ((Call(1, True, True, "now", None), Call(0, True, False, "batch", None),
      Call(0, False, True, None, "now")), "before it is sent"),
    ((Call(0, True, False, "batch", None), Call(1, True, True, "now", None)),
     "never forward or never backward"),
    ((Call(0, True, False, "batch", None), Call(1, True, False, "now", None),
      Call(0, False, True, None, "inbox")), "the last stage's call"),
    ((Call(0, True, False, "inbox", None), Call(1, True, True, "inbox", None),
      Call(0, False, True, None, "inbox")), "only stage 0 reads the batch"),
])
def test_the_validator_refuses_plans_that_cannot_run(calls, match):
  K = max(c.stage for c in calls) + 1
  if match is None:
    assert Plan("ok", K, calls).delays == (1, 0)
    return
  with pytest.raises(ValueError, match=match):
    Plan("bad", K, calls)


# ------------------------------------------------------------------------------ a plan of one's own
def delayed_backprop(K):
  """Every stage but the last applies the previous batch's gradient (delay 1): the whole
  forward, then the backward of the batch before, its cotangents passed on within the tick."""
  calls = [Call(0, True, False, "batch", None)]
  calls += [Call(k, True, False, "now", None) for k in range(1, K - 1)]
  calls += [Call(K - 1, True, True, "now", None), Call(K - 2, False, True, None, "inbox")]
  calls += [Call(k, False, True, None, "now") for k in reversed(range(K - 2))]
  return Plan("delayed_backprop", K, tuple(calls))


def reference_delayed_backprop(applies, params, opt, data):
  """Independent: at tick t, forward b_t at the current weights (stashing each stage's vjp),
  the last stage's update on b_t; then stages K-2..0 apply b_{t-1}'s gradient from the
  stashed vjps and the last stage's cotangent of tick t-1."""
  K = len(applies)
  theta = list(params)
  states = [opt.init(p) for p in theta]
  pending = None  # (vjps of stages 0..K-2 for b_{t-1}, cotangent of stage K-2)
  for x, y in data:
    vjps, h = [], x
    for k in range(K - 1):
      h, vjp = jax.vjp(lambda p, a, k=k: applies[k](p, {}, a, train=True)[0], theta[k], h)
      vjps.append(vjp)
    g, cot = jax.grad(lambda p, a: loss_fn(applies[K - 1](p, {}, a, train=True)[0], y),
                      (0, 1))(theta[K - 1], h)
    u, states[K - 1] = opt.update(g, states[K - 1], theta[K - 1])
    theta[K - 1] = optax.apply_updates(theta[K - 1], u)
    if pending is not None:
      old_vjps, c = pending
      for k in reversed(range(K - 1)):
        gk, c = old_vjps[k](c)
        u, states[k] = opt.update(gk, states[k], theta[k])
        theta[k] = optax.apply_updates(theta[k], u)
    pending = (vjps, cot)
  return theta


@pytest.mark.parametrize("devices", [None, 3])
def test_a_plan_of_one_s_own_runs_on_every_engine_as_its_reference(devices):
  K = 3
  p = delayed_backprop(K)
  assert p.delays == (1, 1, 0) and p.ring_sizes == (2, 2, 0)
  applies, params, states = make_model("mlp", K)
  data = batches(9)
  opt = optax.sgd(0.05, momentum=0.9)
  sched = fdg_jax.Schedule(p, [fdg_jax.Stage(apply=a) for a in applies], loss_fn, opt,
                           devices=None if devices is None else jax.devices()[:K])
  state = sched.init(params, states)
  for b in data:
    state, _ = sched.step(state, b)
  want = reference_delayed_backprop(applies, params, opt, data)
  assert_trees_close(jax.device_get(sched.params(state)), want, atol=1e-5)


# ------------------------------------------------------------------------------ GPipe, 1F1B
def test_micro_batch_orders_and_stash_peaks():
  g = plans.microbatch_order("gpipe", 4, 3)
  assert g[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
  o = plans.microbatch_order("1f1b", 4, 6)
  assert o[0][:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
  assert o[3][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
  for K, M in ((4, 8), (4, 2), (3, 3)):
    assert [plans.peak_stash(x) for x in plans.microbatch_order("gpipe", K, M)] == [M] * K
    assert [plans.peak_stash(x) for x in plans.microbatch_order("1f1b", K, M)] == [
        min(M, K - k) for k in range(K)]
    for name in ("gpipe", "1f1b"):
      orders = plans.microbatch_order(name, K, M)
      seq = plans.global_order(orders)
      where = {(k, kind, m): i for i, (k, kind, m) in enumerate(seq)}
      for k in range(K):  # each device's own order is kept
        assert [(kind, m) for kk, kind, m in seq if kk == k] == orders[k]
        for m in range(M):
          if k:
            assert where[(k - 1, "F", m)] < where[(k, "F", m)]
          if k < K - 1:
            assert where[(k + 1, "B", m)] < where[(k, "B", m)]
          assert where[(k, "F", m)] < where[(k, "B", m)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("devices", [None, 4])
def test_sync_pipelines_equal_bp(name, devices):
  K, M = 4, 4
  applies, params, states = make_model("mlp", K)
  data = batches(20, batch_size=16)
  opt = lambda: optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.05, momentum=0.9))
  stages = [fdg_jax.Stage(apply=a) for a in applies]
  ref = fdg_jax.bp(stages, loss_fn, opt())
  st = ref.init(params, states)
  for b in data:
    st, _ = ref.step(st, b)
  sched = fdg_jax.create(name, stages, loss_fn, opt(), microbatches=M,
                         devices=None if devices is None else jax.devices()[:K])
  assert sched.engine == ("fused" if devices is None else "per_stage")
  state = sched.init(params, states)
  xs, ys = (np.stack([np.asarray(b[i]) for b in data]) for i in (0, 1))
  state, m = sched.run(state, (xs[:12], ys[:12]))
  for b in data[12:]:
    state, _ = sched.step(state, b)
  assert_trees_close(jax.device_get(sched.params(state)), jax.device_get(ref.params(st)),
                     atol=1e-5)
  assert sched.delays == (0,) * K and list(m["updated"][3]) == [3] * K
  assert sched.peak_stash == ((M,) * K if name == "gpipe" else (4, 3, 2, 1))


def test_sync_pipelines_refuse_what_they_cannot_do():
  applies, _, _ = make_model("mlp", 2)
  stages = [fdg_jax.Stage(apply=a) for a in applies]
  with pytest.raises(ValueError, match="takes no beta"):
    fdg_jax.gpipe(stages, loss_fn, optax.sgd(0.1), microbatches=2, beta=0.5)
  with pytest.raises(ValueError, match="1f1b chains its stages within a tick: use engine="):
    fdg_jax.one_f_one_b(stages, loss_fn, optax.sgd(0.1), microbatches=2, engine="spmd")
  with pytest.raises(ValueError, match="microbatches is an option of gpipe"):
    fdg_jax.create("fdg", stages, loss_fn, optax.sgd(0.1), microbatches=2)
  sched = fdg_jax.gpipe(stages, loss_fn, optax.sgd(0.1), microbatches=3)
  state = sched.init(*make_model("mlp", 2)[1:])
  with pytest.raises(ValueError, match="does not split into microbatches=3"):
    sched.step(state, batches(1, batch_size=8)[0])


def test_the_trainer_runs_gpipe_and_1f1b_like_bp(tmp_path):
  from fdg_jax import trainer
  from test_trainer import tiny_config
  runs = {}
  for name in ("bp", "gpipe", "1f1b"):
    c = tiny_config(algorithm=name, num_stages=3, num_epochs=1, microbatches=4)
    runs[name] = trainer.train_and_evaluate(c, str(tmp_path / name))
  for name in ("gpipe", "1f1b"):
    assert_trees_close(runs[name]["params"], runs["bp"]["params"], atol=1e-5)
    assert abs(runs[name]["test_loss"] - runs["bp"]["test_loss"]) < 1e-5
  with pytest.raises(trainer.ConfigError, match="microbatches=5 must"):
    trainer.validate(tiny_config(algorithm="gpipe", microbatches=5))


def test_a_registered_tick_kind_is_what_every_engine_asks(monkeypatch):
  """A new kind of tick is one TickKind subclass and one register line: here the delayed
  kind with its `finish` counted, claimed for FDG only. Both engines finish each tick
  through it (not through the schedule), and the numbers are the built-in kind's."""
  from fdg_jax import tick_kinds
  applies, params, model_state = make_model("mlp", 3)
  stages = [fdg_jax.Stage(apply=a) for a in applies]
  data = batches(5)

  def train(engine):
    sched = fdg_jax.fdg(stages, loss_fn, optax.sgd(0.1), engine=engine)
    state = sched.init(params, model_state)
    for b in data:
      state, _ = sched.step(state, b)
    return sched, jax.device_get(sched.params(state))

  before = {e: train(e)[1] for e in ("fused", "per_stage")}
  finished = []

  class Counted(type(tick_kinds.DELAYED)):
    name = "counted"

    def selects(self, plan):
      return plan.name == "fdg"

    def finish(self, *args):
      finished.append(args[4])  # the tick
      return super().finish(*args)

  monkeypatch.setattr(tick_kinds, "KINDS", list(tick_kinds.KINDS))
  monkeypatch.setattr(tick_kinds, "_GENERATION", tick_kinds.generation())
  counted = tick_kinds.register(Counted())
  for engine in ("fused", "per_stage"):
    finished.clear()
    sched, after = train(engine)
    assert sched.plan.kind is counted and finished == list(range(len(data))), engine
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after),
                                                    jax.tree.leaves(before[engine])))
  assert plans.plan("ddg", 3).kind is tick_kinds.DELAYED  # not claimed: the built-in kind
  monkeypatch.undo()  # the built-in kinds alone again: the same plan asks again
  assert plans.plan("fdg", 3).kind is tick_kinds.DELAYED
  with pytest.raises(TypeError, match="a tick kind is a fdg_jax.tick_kinds.TickKind"):
    tick_kinds.register(object())
