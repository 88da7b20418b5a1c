"""Delay-aware optimisers (fdg_jax.staleness) against plain-numpy transcriptions of the papers.

The transcriptions below loop over ticks in float64 numpy on a flat weight vector and index the
stale gradients by forward number (forward i at tick i, its gradient applied d ticks later); the
transforms run in float32 on a two-leaf pytree through a deque-driven FIFO, the way the schedule
drives them (FDG: update then forward per tick; DDG: forward then update).
"""

from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fdg_jax import staleness as st
from fdg_jax.optim import make_optimizer, methods

LR, MOM = 0.05, 0.9
SHAPES = {"b": (2, 3), "w": (5,)}
SIZE = 11
TICKS = 14


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  x0 = rng.normal(size=SIZE)
  coef = rng.uniform(0.5, 1.5, size=SIZE)          # gradient = coef * forward weights + noise
  noise = rng.normal(size=(TICKS, SIZE))
  return x0, coef, noise


def _tree(flat):
  flat = np.asarray(flat, np.float32)
  return {"b": jnp.asarray(flat[:6].reshape(2, 3)), "w": jnp.asarray(flat[6:])}


def _flat(tree):
  return np.asarray(ravel_pytree(tree)[0], np.float64)


def run_transform(tx, problem, delay, order="fdg", ticks=TICKS):
  """Drives tx through a FIFO of outstanding forwards; returns (forward weights, params by tick)."""
  x0, coef, noise = problem
  tx = st.with_forward(tx)
  params = _tree(x0)
  state = tx.init(params)
  queue, forwards, trajectory = deque(), [], []
  coef_t = _tree(coef)

  def do_forward(t):
    nonlocal state
    fwd, state = tx.forward(params, state)
    forwards.append(_flat(fwd))
    queue.append(jax.tree.map(lambda c, p, n: c * p + n, coef_t, fwd, _tree(noise[t])))

  def do_update():
    nonlocal params, state
    updates, state = tx.update(queue.popleft(), state, params)
    params = optax.apply_updates(params, updates)

  for t in range(ticks):
    if order == "ddg":
      do_forward(t)
      if len(queue) == delay + 1:
        do_update()
    else:
      if len(queue) == delay and delay > 0:
        do_update()
      do_forward(t)
      if delay == 0:
        do_update()
    trajectory.append(_flat(params))
  return np.array(forwards), np.array(trajectory)


def run_reference(method, problem, delay, order="fdg", ticks=TICKS):
  """The same ticks in numpy: forward i at tick i, update i (forward i's gradient) at tick i+d."""
  x0, coef, noise = problem
  x = x0.astype(np.float64).copy()
  fwd, grads, forwards, trajectory = [], [], [], []

  def forward(t):
    xf = method.forward(x)
    fwd.append(xf)
    forwards.append(xf)
    grads.append(coef * xf + noise[t])

  for t in range(ticks):
    if order == "ddg":
      forward(t)
      if t >= delay:
        x = method.step(x, grads[t - delay], fwd[t - delay], t - delay)
    else:
      if delay > 0 and t >= delay:
        x = method.step(x, grads[t - delay], fwd[t - delay], t - delay)
      forward(t)
      if delay == 0:
        x = method.step(x, grads[t], fwd[t], t)
    trajectory.append(x.copy())
  return np.array(forwards), np.array(trajectory)


# ---------------------------------------------------------------------- transcriptions


class PipeMareSGDM:
  """SGDM with eta_i = eta * d^-(1 - min(i/T, 1)), i the update number."""

  def __init__(self, d, ramp):
    self.d, self.ramp, self.v = d, ramp, np.zeros(SIZE)

  def forward(self, x):
    return x.copy()

  def step(self, x, g, xf, i):
    self.v = MOM * self.v + g
    p = 1.0 - min(i / self.ramp, 1.0)
    return x - LR * self.d ** (-p) * self.v


class SpecTrain:
  """SGDM; the forward runs at x - s*eta*v (SpecTrain / Kosson LWP, velocity form)."""

  def __init__(self, s):
    self.s, self.v = s, np.zeros(SIZE)

  def forward(self, x):
    return x - self.s * LR * self.v

  def step(self, x, g, xf, i):
    self.v = MOM * self.v + g
    return x - LR * self.v


class SpikeCompensation:
  """v <- m v + g; x <- x - eta (m^D v + (1 - m^D)/(1 - m) g)."""

  def __init__(self, d):
    self.d, self.v = d, np.zeros(SIZE)

  def forward(self, x):
    return x.copy()

  def step(self, x, g, xf, i):
    self.v = MOM * self.v + g
    a = MOM ** self.d
    b = sum(MOM ** j for j in range(self.d))   # (1 - m^D)/(1 - m) as the geometric sum
    return x - LR * (a * self.v + b * g)


class DCASGD:
  """g <- g + lam g^2 (x - x_fwd), then SGDM; adaptive: lam = lam0/sqrt(M + eps)."""

  def __init__(self, lam=0.04, adaptive=False, decay=0.95, lam0=2.0, eps=1e-7):
    self.lam, self.adaptive, self.decay, self.lam0, self.eps = lam, adaptive, decay, lam0, eps
    self.v, self.meansq = np.zeros(SIZE), np.zeros(SIZE)

  def forward(self, x):
    return x.copy()

  def step(self, x, g, xf, i):
    lam = self.lam
    if self.adaptive:
      self.meansq = self.decay * self.meansq + (1 - self.decay) * g ** 2
      lam = self.lam0 / np.sqrt(self.meansq + self.eps)
    gc = g + lam * g * g * (x - xf)
    self.v = MOM * self.v + gc
    return x - LR * self.v


class PipeNAG:
  """Forward at x + gamma*(x_t - x_{t-1}); x_{t+1} = x_t + gamma*(x_t - x_{t-1}) - eta(1-gamma)g."""

  def __init__(self, gamma):
    self.gamma, self.prev = gamma, None

  def forward(self, x):
    prev = x if self.prev is None else self.prev
    return x + self.gamma * (x - prev)

  def step(self, x, g, xf, i):
    prev = x if self.prev is None else self.prev
    new = x + self.gamma * (x - prev) - LR * (1 - self.gamma) * g
    self.prev = x.copy()
    return new


def _close(actual, expected):
  np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------- transcription tests


@pytest.mark.parametrize("order", ["fdg", "ddg"])
def test_lr_by_delay_matches_pipemare(order):
  d, ramp = 3, 5
  problem = _problem(1)
  tx = optax.chain(optax.sgd(LR, momentum=MOM), st.lr_by_delay(d, ramp))
  fwd, traj = run_transform(tx, problem, d, order)
  ref_fwd, ref_traj = run_reference(PipeMareSGDM(d, ramp), problem, d, order)
  _close(fwd, ref_fwd)
  _close(traj, ref_traj)


def test_lr_by_delay_factor_ramps_to_one():
  tx = st.lr_by_delay(4, 2)
  state = tx.init({"a": jnp.zeros(1)})
  seen = []
  for _ in range(4):
    upd, state = tx.update({"a": jnp.ones(1)}, state)
    seen.append(float(upd["a"][0]))
  np.testing.assert_allclose(seen, [0.25, 0.5, 1.0, 1.0], rtol=1e-6)


@pytest.mark.parametrize("order", ["fdg", "ddg"])
@pytest.mark.parametrize("d", [1, 4])
def test_weight_prediction_matches_spectrain_form(order, d):
  problem = _problem(2)
  tx = st.weight_prediction(optax.sgd(LR, momentum=MOM), d)
  fwd, traj = run_transform(tx, problem, d, order)
  ref_fwd, ref_traj = run_reference(SpecTrain(d), problem, d, order)
  _close(fwd, ref_fwd)
  _close(traj, ref_traj)


def test_weight_prediction_horizon_overrides_delay():
  problem = _problem(3)
  tx = st.weight_prediction(optax.sgd(LR, momentum=MOM), 4, horizon=2.5)
  fwd, traj = run_transform(tx, problem, 4)
  ref_fwd, ref_traj = run_reference(SpecTrain(2.5), problem, 4)
  _close(fwd, ref_fwd)
  _close(traj, ref_traj)


@pytest.mark.parametrize("order", ["fdg", "ddg"])
@pytest.mark.parametrize("d", [1, 2, 6])
def test_spike_compensation_matches_kosson(order, d):
  problem = _problem(4)
  fwd, traj = run_transform(st.spike_compensation(LR, d, MOM), problem, d, order)
  ref_fwd, ref_traj = run_reference(SpikeCompensation(d), problem, d, order)
  _close(fwd, ref_fwd)
  _close(traj, ref_traj)


def test_spike_compensation_takes_a_schedule():
  sched = optax.linear_schedule(LR, LR / 4, 10)
  problem = _problem(5)
  d = 2
  _, traj = run_transform(st.spike_compensation(sched, d, MOM), problem, d)
  x0, coef, noise = problem
  x, v, fwd = x0.copy(), np.zeros(SIZE), []
  expected = []
  for t in range(TICKS):
    if t >= d:
      i = t - d
      g = coef * fwd[i] + noise[i]
      v = MOM * v + g
      eta = LR + (LR / 4 - LR) * min(i / 10, 1.0)
      x = x - eta * (MOM ** d * v + (1 - MOM ** d) / (1 - MOM) * g)
    fwd.append(x.copy())
    expected.append(x.copy())
  _close(traj, np.array(expected))


@pytest.mark.parametrize("order", ["fdg", "ddg"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_dc_matches_dcasgd(order, adaptive):
  d = 3
  problem = _problem(6)
  kw = dict(lam=0.5, adaptive=adaptive, decay=0.9, lam0=0.3, eps=1e-7)
  tx = st.chain(st.delay_compensation(d, **kw), optax.sgd(LR, momentum=MOM))
  fwd, traj = run_transform(tx, problem, d, order)
  ref_fwd, ref_traj = run_reference(DCASGD(**kw), problem, d, order)
  _close(fwd, ref_fwd)
  _close(traj, ref_traj)
  # The correction is really active: without it the trajectory differs.
  _, plain_traj = run_transform(optax.sgd(LR, momentum=MOM), problem, d, order)
  assert np.abs(plain_traj - traj).max() > 1e-4


@pytest.mark.parametrize("order", ["fdg", "ddg"])
@pytest.mark.parametrize("d", [0, 2, 5])
def test_nesterov_delay_matches_pipenag(order, d):
  gamma = 0.8
  problem = _problem(7)
  fwd, traj = run_transform(st.nesterov_delay(LR, d, momentum=gamma), problem, d, order)
  ref_fwd, ref_traj = run_reference(PipeNAG(gamma), problem, d, order)
  _close(fwd, ref_fwd)
  _close(traj, ref_traj)


def test_nesterov_delay_at_zero_delay_is_not_plain_sgd():
  problem = _problem(8)
  _, traj = run_transform(st.nesterov_delay(LR, 0, momentum=0.5), problem, 0)
  _, plain = run_transform(optax.sgd(LR, momentum=0.5), problem, 0)
  assert np.abs(traj - plain).max() > 1e-3


# ---------------------------------------------------------------------- bitwise d = 0


def _bits(tree):
  return [np.asarray(a).view(np.uint32) for a in jax.tree.leaves(tree)]


def _assert_bitwise(a, b):
  for x, y in zip(_bits(a), _bits(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _gradients(steps=6, seed=9):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    g = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    g["w"][0] = 0.0
    g["w"][1] = -0.0
    g["b"][0, 0] = -0.0
    out.append(jax.tree.map(jnp.asarray, g))
  out.append(jax.tree.map(jnp.zeros_like, out[0]))
  out.append(jax.tree.map(lambda a: -jnp.zeros_like(a), out[0]))
  out.append(out[0])
  return out


def _params(seed=10):
  rng = np.random.default_rng(seed)
  p = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  p["w"][2] = -0.0
  return jax.tree.map(jnp.asarray, p)


def _drive(tx, jit=False, identity_forward=True):
  tx = st.with_forward(tx)
  update, forward = (jax.jit(tx.update), jax.jit(tx.forward)) if jit else (tx.update, tx.forward)
  params = _params()
  state = tx.init(params)
  log = []
  for g in _gradients():
    fwd, state = forward(params, state)
    if identity_forward:
      _assert_bitwise(fwd, params)
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
    log.append((updates, params))
  return log


def _assert_same_runs(a, b):
  for (ua, pa), (ub, pb) in zip(a, b, strict=True):
    _assert_bitwise(ua, ub)
    _assert_bitwise(pa, pb)


HPARAMS = {"none": {}, "lr_by_delay": {"ramp_steps": 5}, "weight_prediction": {},
           "spike_compensation": {}, "dc": {"lam": 0.5, "adaptive": True},
           "error_feedback": {"strength": 0.5},
           "discrepancy_correction": {"discrepancy_decay": 0.8}}


@pytest.mark.parametrize("method", [m for m in st.METHODS if m != "nesterov_delay"])
@pytest.mark.parametrize("wd", [0.0, 5e-4])
@pytest.mark.parametrize("jit", [False, True])
def test_stage_optimizer_zero_delay_is_plain_bitwise(method, wd, jit):
  base = make_optimizer("sgd", LR, momentum=MOM, weight_decay=wd)
  tx = st.stage_optimizer(method, base, delay=0, learning_rate=LR, momentum=MOM,
                          weight_decay=wd, hparams=HPARAMS[method])
  _assert_same_runs(_drive(tx, jit), _drive(base, jit))


@pytest.mark.parametrize("method", ["none", "lr_by_delay", "weight_prediction", "dc"])
def test_stage_optimizer_zero_delay_is_plain_bitwise_adam(method):
  base = make_optimizer("adam", 1e-3, weight_decay=1e-2)
  tx = st.stage_optimizer(method, base, delay=0, learning_rate=1e-3, momentum=0.0,
                          weight_decay=1e-2, hparams=HPARAMS[method], optimizer="adam")
  _assert_same_runs(_drive(tx), _drive(base))


def test_factories_zero_delay_are_plain_bitwise():
  base = optax.sgd(LR, momentum=MOM)
  plain = _drive(base)
  _assert_same_runs(_drive(optax.chain(base, st.lr_by_delay(0, 5))), plain)
  _assert_same_runs(_drive(optax.chain(base, st.lr_by_delay(1, 5))), plain)
  _assert_same_runs(_drive(st.weight_prediction(base, 0)), plain)
  _assert_same_runs(_drive(st.spike_compensation(LR, 0, MOM)), plain)
  _assert_same_runs(_drive(st.chain(st.delay_compensation(0, adaptive=True), base)), plain)
  _assert_same_runs(_drive(st.chain(st.delay_compensation(0), base)), plain)


def test_spike_compensation_zero_delay_is_optax_sgd():
  sched = optax.cosine_decay_schedule(LR, 20)
  _assert_same_runs(_drive(st.spike_compensation(sched, 0, MOM)),
                    _drive(optax.sgd(sched, momentum=MOM)))


# ---------------------------------------------------------------------- chain and state


def test_chain_equals_optax_chain_bitwise():
  parts = (optax.add_decayed_weights(1e-3), optax.clip_by_global_norm(1.0),
           optax.sgd(optax.linear_schedule(LR, 0.0, 8), momentum=MOM, nesterov=True))
  _assert_same_runs(_drive(st.chain(*parts)), _drive(optax.chain(*parts)))
  _assert_same_runs(_drive(st.chain(*parts), jit=True), _drive(optax.chain(*parts), jit=True))


def test_chain_threads_forward_hooks_in_order():
  lookahead = st.nesterov_delay(LR, 2, momentum=0.5)
  dc = st.delay_compensation(2)
  tx = st.chain(lookahead, dc)
  params = _params()
  state = tx.init(params)
  updates, state = tx.update(_gradients()[0], state, params)
  params = optax.apply_updates(params, updates)
  fwd, state = tx.forward(params, state)
  expected, _ = lookahead.forward(params, state[0])
  _assert_bitwise(fwd, expected)
  # dc (later in the chain) recorded the look-ahead weights the forward really ran at.
  _assert_bitwise(jax.tree.map(lambda r: r[0], state[1].ring), expected)


def _all_methods(d):
  base = make_optimizer("sgd", LR, momentum=MOM, weight_decay=5e-4)
  out = {}
  for method in st.METHODS:
    hp = {"ramp_steps": 5} if method == "lr_by_delay" else {}
    if method == "dc":
      hp = {"adaptive": True}
    out[method] = st.stage_optimizer(method, base, delay=d, learning_rate=LR, momentum=MOM,
                                     weight_decay=5e-4, hparams=hp)
  out["dc_plain"] = st.stage_optimizer("dc", base, delay=d, learning_rate=LR, momentum=MOM,
                                       weight_decay=5e-4, hparams={})
  return out


@pytest.mark.parametrize("d", [0, 1, 4])
def test_state_is_fixed_shape_and_maskable(d):
  params, grads = _params(), _gradients()[0]
  for name, tx in _all_methods(d).items():
    assert isinstance(tx, st.DelayedTransformation), name
    state = tx.init(params)
    init_shape = jax.eval_shape(tx.init, params)
    upd_shape = jax.eval_shape(lambda s: tx.update(grads, s, params)[1], state)
    fwd_shape = jax.eval_shape(lambda s: tx.forward(params, s)[1], state)
    assert jax.tree.structure(upd_shape) == jax.tree.structure(init_shape), name
    assert jax.tree.structure(fwd_shape) == jax.tree.structure(init_shape), name
    for a, b, c in zip(jax.tree.leaves(init_shape), jax.tree.leaves(upd_shape),
                       jax.tree.leaves(fwd_shape)):
      assert (a.shape, a.dtype) == (b.shape, b.dtype) == (c.shape, c.dtype), name
    for leaf in jax.tree.leaves(state):
      assert isinstance(leaf, jax.Array), name
      assert leaf.dtype in (jnp.float32, jnp.int32), name

    @jax.jit
    def masked_tick(state, active):
      _, new = tx.update(grads, state, params)
      state = jax.tree.map(lambda n, o: jnp.where(active, n, o), new, state)
      _, new = tx.forward(params, state)
      return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, state)

    held = masked_tick(state, jnp.asarray(False))
    _assert_bitwise(held, state)
    masked_tick(state, jnp.asarray(True))


def test_methods_run_under_jit_like_eagerly():
  for name, tx in _all_methods(3).items():
    eager = _drive(tx, identity_forward=False)
    jitted = _drive(tx, jit=True, identity_forward=False)
    for (ue, pe), (uj, pj) in zip(eager, jitted, strict=True):
      for a, b in zip(jax.tree.leaves(pj), jax.tree.leaves(pe)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------- registry and errors


def test_registry_builds_the_expected_pieces():
  base = make_optimizer("sgd", LR, momentum=MOM)
  kw = dict(delay=2, learning_rate=LR, momentum=MOM, weight_decay=0.0)
  none = st.stage_optimizer("none", base, **kw, hparams={})
  assert none.init is base.init and none.update is base.update
  # nesterov_delay defaults: gamma 0.99 and the base's effective step LR/(1-MOM).
  tx = st.stage_optimizer("nesterov_delay", base, **kw, hparams={})
  ref = st.nesterov_delay(LR / (1 - MOM), 2, momentum=0.99)
  _assert_same_runs(_drive(tx, identity_forward=False), _drive(ref, identity_forward=False))
  tx = st.stage_optimizer("nesterov_delay", base, **kw, hparams={"gamma": 0.5,
                                                                 "learning_rate": 0.3})
  _assert_same_runs(_drive(tx, identity_forward=False),
                    _drive(st.nesterov_delay(0.3, 2, momentum=0.5), identity_forward=False))


@pytest.mark.parametrize("method, kwargs, hparams, match", [
    ("bogus", {}, {}, "unknown staleness method"),
    ("spike_compensation", {"momentum": 0.0}, {}, "momentum"),
    ("spike_compensation", {"optimizer": "adam"}, {}, "does not apply"),
    ("spike_compensation", {"nesterov": True}, {}, "Nesterov"),
    ("nesterov_delay", {"optimizer": "adam"}, {}, "does not apply"),
    ("lr_by_delay", {}, {}, "ramp_steps"),
    ("dc", {}, {"ramp_steps": 3}, "unknown"),
    ("none", {"delay": -1}, {}, "non-negative"),
])
def test_stage_optimizer_errors(method, kwargs, hparams, match):
  kw = dict(delay=2, learning_rate=LR, momentum=MOM, weight_decay=0.0)
  kw.update(kwargs)
  with pytest.raises(ValueError, match=match):
    st.stage_optimizer(method, optax.sgd(LR), hparams=hparams, **kw)


# ---------------------------------------------------------------------- combinations


def _default_config():
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py"
  spec = importlib.util.spec_from_file_location("cfg_default_registry", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_every_registry_field_is_a_valid_field_of_the_default_config():
  c = _default_config()
  fields = [h.field for m in methods.REGISTRY.values() for h in m.hparams if h.field]
  assert len(fields) == len(set(fields)) == 10
  assert all(f in c for f in fields), [f for f in fields if f not in c]
  assert methods.config_problem(c) is None


def test_the_trainer_reads_each_methods_settings_from_its_config_fields():
  c = _default_config()
  c.staleness = ("lr_by_delay+weight_prediction+dc+nesterov_delay+error_feedback+"
                 "discrepancy_correction")  # read, not built: clashing parts are fine here
  c.staleness_ramp_epochs, c.staleness_horizon, c.dc_lambda = 1.5, 3.0, 0.5
  assert methods.config_hparams(c, 44) == {
      "ramp_steps": 66, "power": c.staleness_lr_power, "horizon": 3.0, "lam": 0.5,
      "adaptive": c.dc_adaptive, "decay": c.dc_decay, "lam0": c.dc_lambda0,
      "gamma": c.nesterov_gamma, "strength": c.staleness_strength,
      "discrepancy_decay": c.discrepancy_decay}
  c.staleness_ramp_epochs, c.staleness_horizon = -1.0, -1.0  # no ramp; the delay itself
  assert methods.config_hparams(c, 44)["ramp_steps"] is None
  assert methods.config_hparams(c, 44)["horizon"] is None
  c.staleness = "spike_compensation"
  assert methods.config_hparams(c, 44) == {}
  c.staleness = "none"
  assert methods.config_hparams(c, 44) == {}


def test_a_method_declared_once_reaches_validation_the_trainer_and_the_builder(monkeypatch):
  """A new method is one REGISTRY entry: its name, its hparam's config field with the
  field's range, and its builder; config validation, the trainer's settings and
  stage_optimizer all read it."""
  def build(inner, delay, settings, base):
    del base
    return st.chain(inner, optax.scale(settings["shrink"] ** delay))
  toy = methods.Method("toy", build, layer=2, hparams=(
      methods.Hparam("shrink", 0.5, field="toy_shrink", valid=lambda v: 0 < v <= 1,
                     expect="must lie in (0, 1]"),))
  monkeypatch.setitem(methods.REGISTRY, "toy", toy)
  c = _default_config()
  c.staleness, c.toy_shrink = "toy", 0.25
  assert methods.config_problem(c) is None
  assert methods.config_hparams(c, 44) == {"shrink": 0.25}
  c.toy_shrink = 2.0
  assert methods.config_problem(c) == "toy_shrink=2.0 must lie in (0, 1]"
  c.staleness = "toy+dc"
  assert methods.config_problem(c) == "toy_shrink=2.0 must lie in (0, 1]"
  base = optax.sgd(LR)
  kw = dict(learning_rate=LR, momentum=0.0, weight_decay=0.0)
  tx = st.stage_optimizer("toy", base, delay=2, hparams={"shrink": 0.5}, **kw)
  g = {"w": jnp.ones((3,), jnp.float32)}
  u, _ = tx.update(g, tx.init(g), g)
  np.testing.assert_array_equal(u["w"], np.full(3, -LR * 0.25, np.float32))
  plain = st.stage_optimizer("toy", base, delay=0, **kw)  # delay 0: the base itself
  assert plain.init is base.init and plain.update is base.update
  with pytest.raises(ValueError, match="unknown"):
    st.stage_optimizer("toy", base, delay=2, hparams={"strength": 1.0}, **kw)


@pytest.mark.parametrize("method", ["spike_compensation+weight_prediction",
                                    "lr_by_delay+spike_compensation", "dc+lr_by_delay"])
def test_combination_zero_delay_is_plain_bitwise(method):
  base = make_optimizer("sgd", LR, momentum=MOM, weight_decay=5e-4)
  hparams = {"ramp_steps": 5, "lam": 0.5}
  hparams = {k: v for k, v in hparams.items()
             if any(k in methods.REGISTRY[m].hparam_names for m in method.split("+"))}
  tx = st.stage_optimizer(method, base, delay=0, learning_rate=LR, momentum=MOM,
                          weight_decay=5e-4, hparams=hparams)
  _assert_same_runs(_drive(tx), _drive(base))


def test_combination_is_the_composition_of_its_parts():
  """spike_compensation+weight_prediction+lr_by_delay: the forward extrapolates the update
  that the spike-compensated, delay-scaled rule applies, as composed by hand."""
  d, problem = 3, _problem(4)
  base = optax.sgd(LR, momentum=MOM)
  combo = st.stage_optimizer("spike_compensation+weight_prediction+lr_by_delay", base,
                             delay=d, learning_rate=LR, momentum=MOM, weight_decay=0.0,
                             hparams={"ramp_steps": 6})
  by_hand = st.weight_prediction(
      st.chain(st.spike_compensation(LR, d, MOM), st.lr_by_delay(d, 6)), d)
  got_fwd, got_traj = run_transform(combo, problem, d)
  want_fwd, want_traj = run_transform(by_hand, problem, d)
  np.testing.assert_array_equal(np.asarray(got_fwd), np.asarray(want_fwd))
  np.testing.assert_array_equal(np.asarray(got_traj), np.asarray(want_traj))
  plain_fwd, _ = run_transform(st.spike_compensation(LR, d, MOM), problem, d)
  assert np.abs(np.asarray(got_fwd) - np.asarray(plain_fwd)).max() > 1e-4


@pytest.mark.parametrize("method,match", [
    ("spike_compensation+nesterov_delay", "at most one"),
    ("dc+weight_prediction", "at most one"),
    ("dc+dc", "repeats"),
    ("dc+magic", "unknown"),
])
def test_bad_combinations_are_refused(method, match):
  with pytest.raises(ValueError, match=match):
    st.parse_methods(method)


def test_lr_by_delay_without_ramp_keeps_one_over_delay():
  d = 4
  tx = st.lr_by_delay(d, None)
  g = {"w": jnp.ones((3,), jnp.float32)}
  state = tx.init(g)
  for _ in range(5):
    u, state = tx.update(g, state)
    np.testing.assert_allclose(np.asarray(u["w"]), 1.0 / d, rtol=1e-7)
  assert st.lr_by_delay(1, None) is not None
  u, _ = st.lr_by_delay(1, None).update(g, st.lr_by_delay(1, None).init(g))
  np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(g["w"]))


def test_lr_by_delay_power():
  g = {"w": jnp.ones((2,), jnp.float32)}
  tx = st.lr_by_delay(9, None, power=0.5)
  u, _ = tx.update(g, tx.init(g))
  np.testing.assert_allclose(np.asarray(u["w"]), 1.0 / 3.0, rtol=1e-6)
  ramp = st.lr_by_delay(9, 4, power=0.5)
  state = ramp.init(g)
  for t in range(6):
    u, state = ramp.update(g, state)
    np.testing.assert_allclose(np.asarray(u["w"]), 9.0 ** (-0.5 * (1 - min(t / 4, 1))),
                               rtol=1e-6)
