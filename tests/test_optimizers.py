"""The delay-robust optimisers and corrections against float64 numpy transcriptions.

basis_rotation (arXiv 2602.03515), nadam_warmup (PyTorch's NAdam, PipeNAG's optimiser),
error_feedback (update extrapolation) and discrepancy_correction (PipeMare), each written out
below from its formula with numpy's own eigh/QR; then the optimisers by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fdg_jax import optimizers, staleness as st
from fdg_jax.optim import make_optimizer, optimizer_parameters

STEPS = 12


def _grads(shapes, steps=STEPS, seed=0):
  rng = np.random.default_rng(seed)
  return [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
          for _ in range(steps)]


def _drive(tx, params, grads, jit=True):
  """Applies tx to `grads` in turn; returns the params after each step (numpy, float64)."""
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  out = []
  for g in grads:
    u, state = update(jax.tree.map(jnp.asarray, g), state, params)
    params = optax.apply_updates(params, u)
    out.append(jax.tree.map(lambda a: np.asarray(a, np.float64), params))
  return out


# ---------------------------------------------------------------------- basis rotation
def _np_basis_rotation(w, grads, lr, b1, b2, eps, wd, freq, max_dim):
  """The paper code's rule (section `optimizers.basis_rotation`), one leaf, in float64."""
  shape = w.shape
  w = w.astype(np.float64)
  if len(shape) < 2:
    m_, n_ = None, None
  elif len(shape) == 3:  # the closer-to-square of [a, b*c] and [a*b, c]
    options = [(shape[0], shape[1] * shape[2]), (shape[0] * shape[1], shape[2])]
    m_, n_ = min(options, key=lambda mn: abs(np.log(mn[0] / mn[1])))
  else:
    m_, n_ = int(np.prod(shape[:-1])), shape[-1]
  rot_l = m_ is not None and 2 <= m_ <= max_dim
  rot_r = n_ is not None and 2 <= n_ <= max_dim
  plain = not (rot_l or rot_r)
  mu = np.zeros(shape)
  nu = np.zeros(shape if plain else (m_, n_))
  L = np.zeros((m_, m_)) if rot_l else None
  R = np.zeros((n_, n_)) if rot_r else None
  QL = np.eye(m_) if rot_l else None
  QR = np.eye(n_) if rot_r else None

  def eig_desc(a):
    return np.linalg.eigh(a)[1][:, ::-1]

  def power_qr(stat, q, nu, axis):
    est = np.diag(q.T @ stat @ q)
    order = np.argsort(-est, kind="stable")
    q = q[:, order]
    nu = np.take(nu, order, axis=axis)
    return np.linalg.qr(stat @ q)[0], nu

  out = []
  for t, g in enumerate(grads, start=1):
    g = g.astype(np.float64)
    mu = b1 * mu + (1 - b1) * g
    step = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    if plain:
      nu = b2 * nu + (1 - b2) * g * g
      direction = mu / (np.sqrt(nu) + eps)
    else:
      G, M = g.reshape(m_, n_), mu.reshape(m_, n_)
      if rot_l:
        L = b2 * L + (1 - b2) * G @ G.T
      if rot_r:
        R = b2 * R + (1 - b2) * G.T @ G
      if t == 1:
        QL = eig_desc(L) if rot_l else QL
        QR = eig_desc(R) if rot_r else QR
      elif t % freq == 0:
        if rot_l:
          QL, nu = power_qr(L, QL, nu, 0)
        if rot_r:
          QR, nu = power_qr(R, QR, nu, 1)
      A = QL if rot_l else np.eye(m_)
      B = QR if rot_r else np.eye(n_)
      Gt, Mt = A.T @ G @ B, A.T @ M @ B
      nu = b2 * nu + (1 - b2) * Gt * Gt
      direction = (A @ (Mt / (np.sqrt(nu) + eps)) @ B.T).reshape(shape)
    w = w - lr * wd * w - step * direction
    out.append(w.copy())
  return out


# Leaves: a full-rank statistic on one side and a one-dimensional null space on the other (so
# the eigenvectors are unique up to sign, which the update does not see), a multi-head kernel
# viewed as the same [3, 4] (one batched group with "w"), a convolution kernel (viewed as
# [2*1*2, 3]), a side above max_dim (kept unrotated), and a vector (plain Adam).
BR_SHAPES = {"w": (3, 4), "heads": (3, 2, 2), "conv": (2, 1, 2, 3), "tall": (6, 2),
             "b": (4,)}


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_basis_rotation_matches_its_formula(wd):
  grads = _grads(BR_SHAPES)
  params = {k: jnp.asarray(v) for k, v in _grads(BR_SHAPES, 1, seed=1)[0].items()}
  # eps 1e-3: in a null direction of a statistic the rotated gradient is float32 round-off
  # (1e-7), which Adam's division would turn into a full step against float64's 1e-16.
  kw = dict(lr=0.01, b1=0.9, b2=0.95, eps=1e-3, wd=wd, freq=4, max_dim=5)
  tx = optimizers.basis_rotation(0.01, b1=0.9, b2=0.95, eps=1e-3, weight_decay=wd,
                                 frequency=4, max_dim=5)
  got = _drive(tx, params, grads)
  for name in BR_SHAPES:
    want = _np_basis_rotation(np.asarray(params[name]), [g[name] for g in grads], **kw)
    for t in range(STEPS):  # steps 1, 4, 8 refresh the bases (eigh, then power + QR)
      np.testing.assert_allclose(got[t][name], want[t], rtol=1e-4, atol=1e-5,
                                 err_msg=f"{name} at step {t + 1}")


def test_basis_rotation_rotates_matrices_and_keeps_vectors_plain():
  view = optimizers.matrix_view
  assert view((3, 4)) == (3, 4, True, True)
  assert view((64, 4, 16)) == (64, 64, True, True)     # a query kernel [in, heads, dim]
  assert view((4, 16, 64)) == (64, 64, True, True)     # an output kernel [heads, dim, out]
  assert view((3, 3, 16, 32)) == (144, 32, True, True)  # a convolution [h, w, in, out]
  assert view((5000, 64)) == (5000, 64, False, True)
  assert view((7,)) is None and view((1, 1)) is None
  flax_like = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4, 2))},
               "embed": {"embedding": jnp.ones((8, 3))}}
  assert optimizers.default_rotation_mask(flax_like) == {
      "dense": {"kernel": True, "bias": False}, "embed": {"embedding": False}}
  assert optimizers.default_rotation_mask({"w": jnp.ones((2, 2)), "b": jnp.ones(2)}) == {
      "w": True, "b": False}
  params = {"emb": jnp.ones((8, 3)), "w": jnp.ones((3, 4)), "b": jnp.ones(4)}
  mask = lambda p: {"emb": False, "w": True, "b": True}
  state = optimizers.basis_rotation(1e-3, mask=mask).init(params)
  (group,) = state.q_left
  assert group.shape == (1, 3, 3) and state.q_right[0].shape == (1, 4, 4)
  plain, _ = state.nu  # per leaf in key order (b, emb, w): () where rotated
  assert plain[0].shape == (4,) and plain[1].shape == (8, 3) and plain[2] == ()
  # A masked leaf is the same Adam without rotation: a 1-D leaf's rule on its entries.
  grads = _grads({"emb": (8, 3), "w": (3, 4), "b": (4,)}, 5)
  got = _drive(optimizers.basis_rotation(0.01, mask=mask), params, grads)
  want = _np_basis_rotation(np.ones(24), [g["emb"].ravel() for g in grads], 0.01, 0.9, 0.999,
                            1e-8, 0.0, 10, 2048)
  np.testing.assert_allclose(got[-1]["emb"].ravel(), want[-1], rtol=1e-5)


def test_basis_rotation_runs_under_jit_without_retracing():
  params = {"w": jnp.ones((3, 4))}
  tx = optimizers.basis_rotation(1e-3, frequency=2)
  traces = []

  def update(g, s, p):
    traces.append(1)
    return tx.update(g, s, p)

  update = jax.jit(update)
  state = tx.init(params)
  for g in _grads({"w": (3, 4)}, 5):
    _, state = update({"w": jnp.asarray(g["w"])}, state, params)
  assert len(traces) == 1


# ---------------------------------------------------------------------- NAdam (PyTorch's)
def _np_torch_nadam(w, grads, lr, b1, b2, eps, psi, wd):
  w = w.astype(np.float64)
  m, v, prod, out = np.zeros_like(w), np.zeros_like(w), 1.0, []
  for t, g in enumerate(grads, start=1):
    g = g.astype(np.float64)
    w = w * (1 - lr * wd)
    mu = b1 * (1 - 0.5 * 0.96 ** (t * psi))
    mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * psi))
    prod *= mu
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v / (1 - b2 ** t)) + eps
    w = w - lr * (1 - mu) / (1 - prod) * g / denom
    w = w - lr * mu_next / (1 - prod * mu_next) * m / denom
    out.append(w.copy())
  return out


@pytest.mark.parametrize("b1,psi", [(0.99, 0.004), (0.9, 0.5)])
def test_nadam_warmup_matches_pytorch_nadam(b1, psi):
  shapes = {"w": (3, 4), "b": (4,)}
  grads = _grads(shapes)
  params = {k: jnp.asarray(v) for k, v in _grads(shapes, 1, seed=2)[0].items()}
  tx = optimizers.nadam_warmup(3e-3, b1=b1, b2=0.999, eps=1e-8, momentum_decay=psi,
                               weight_decay=0.01)
  got = _drive(tx, params, grads)
  for name in shapes:
    want = _np_torch_nadam(np.asarray(params[name]), [g[name] for g in grads], 3e-3, b1,
                           0.999, 1e-8, psi, 0.01)
    for t in range(STEPS):
      np.testing.assert_allclose(got[t][name], want[t], rtol=1e-5, atol=1e-6)


def test_nadam_warmup_momentum_starts_near_half_of_b1():
  mu = lambda t: 0.99 * (1 - 0.5 * 0.96 ** (t * 0.004))
  assert mu(1) == pytest.approx(0.495, abs=1e-3)
  assert mu(10_000) == pytest.approx(0.893, abs=1e-3)


# ---------------------------------------------------------------------- error feedback
def test_error_feedback_extrapolates_the_update():
  shapes = {"w": (3, 4)}
  grads = _grads(shapes)
  params = {"w": jnp.asarray(_grads(shapes, 1, seed=3)[0]["w"])}
  d, strength, lr, mom = 3, 0.5, 0.05, 0.9
  got = _drive(st.error_feedback(optax.sgd(lr, momentum=mom), d, strength), params, grads)
  w, v, prev = np.asarray(params["w"], np.float64), 0.0, None
  for t, g in enumerate(grads):
    v = mom * v + g["w"]
    u = -lr * v
    w = w + (u if prev is None else u + strength * d * (u - prev))
    prev = u
    np.testing.assert_allclose(got[t]["w"], w, rtol=1e-5, atol=1e-6)


def test_error_feedback_and_discrepancy_at_zero_delay_are_the_inner_transform():
  inner = optax.adam(1e-3)
  assert st.error_feedback(inner, 0).update is inner.update
  assert st.error_feedback(inner, 3, strength=0.0).update is inner.update
  ident = st.discrepancy_correction(0)
  params = {"w": jnp.ones((2, 2))}
  assert ident.backward(params, ident.init(params)) is params


# ---------------------------------------------------------------------- discrepancy correction
def test_discrepancy_correction_reconstructs_older_weights():
  d, decay = 4, 0.8
  tx = st.chain(optax.sgd(0.1), st.discrepancy_correction(d, decay))
  params = {"w": jnp.asarray(np.linspace(-1, 1, 6).reshape(2, 3), jnp.float32)}
  state = tx.init(params)
  delta, w = np.zeros((2, 3)), np.asarray(params["w"], np.float64)
  for g in _grads({"w": (2, 3)}, 6):
    u, state = tx.update({"w": jnp.asarray(g["w"])}, state, params)
    np.testing.assert_allclose(np.asarray(u["w"]), -0.1 * g["w"], rtol=1e-6)  # passed on
    params = optax.apply_updates(params, u)
    w = w - 0.1 * g["w"]
    delta = decay * delta + (1 - decay) * (-0.1 * g["w"])
    back = tx.backward(params, state)
    np.testing.assert_allclose(np.asarray(back["w"]), w - d * delta, rtol=1e-5, atol=1e-6)
  # Forward hooks are untouched: the forward runs at the current weights.
  fwd, _ = tx.forward(params, state)
  assert fwd is params


# ---------------------------------------------------------------------- optimisers by name
def test_optimizers_by_name_are_optax_s_own():
  shapes = {"w": (4, 3), "b": (3,)}
  grads = _grads(shapes, 4)
  params = {k: jnp.asarray(v) for k, v in _grads(shapes, 1, seed=4)[0].items()}
  pairs = [
      (make_optimizer("muon", 0.02, weight_decay=0.0), optax.contrib.muon(0.02)),
      (make_optimizer("lion", 1e-4, weight_decay=0.01, b1=0.95),
       optax.lion(1e-4, b1=0.95, weight_decay=0.01)),
      (make_optimizer("nadam", 1e-3, nesterov=False, weight_decay=0.0), optax.nadam(1e-3)),
      (make_optimizer("adamw", 1e-3, weight_decay=0.05, b2=0.95),
       optax.adamw(1e-3, b2=0.95, weight_decay=0.05)),
      (make_optimizer("adam", 1e-3, weight_decay=0.05), optax.adamw(1e-3, weight_decay=0.05)),
      (make_optimizer("basis_rotation", 1e-3, weight_decay=0.0, frequency=3),
       optimizers.basis_rotation(1e-3, frequency=3)),
  ]
  for ours, theirs in pairs:
    for a, b in zip(_drive(ours, params, grads), _drive(theirs, params, grads)):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("name,kwargs,match", [
    ("bogus", {}, "unknown optimizer 'bogus'"),
    ("adamw", {"b3": 0.9}, "has no parameter b3"),
    ("sgd", {"b1": 0.9}, "optimizer sgd takes momentum"),
    ("nadam", {"weight_decay": 0.1}, "has no weight_decay parameter"),
    ("GradientTransformation", {}, "unknown optimizer"),
])
def test_bad_optimizer_names_and_parameters_are_one_line(name, kwargs, match):
  with pytest.raises(ValueError, match=match) as e:
    make_optimizer(name, 1e-3, **{"weight_decay": 0.0, **kwargs})
  assert "\n" not in str(e.value)


def test_optimizer_parameters_list_what_the_factory_takes():
  assert "ns_steps" in optimizer_parameters("muon")
  assert optimizer_parameters("nadam_warmup") == ("b1", "b2", "eps", "momentum_decay",
                                                  "weight_decay")


def test_a_second_rate_follows_the_schedule():
  sched = optax.cosine_decay_schedule(0.02, 10)
  tx = make_optimizer("muon", sched, weight_decay=0.0, peak_learning_rate=0.02,
                      adam_learning_rate=1e-3)
  ref = optax.contrib.muon(sched, adam_learning_rate=lambda c: sched(c) * 0.05)
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  grads = _grads({"w": (4, 3), "b": (3,)}, 4)
  for a, b in zip(_drive(tx, params, grads), _drive(ref, params, grads)):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(x, y, rtol=1e-6)
  with pytest.raises(ValueError, match="peak_learning_rate"):
    make_optimizer("muon", sched, weight_decay=0.0, adam_learning_rate=1e-3)
