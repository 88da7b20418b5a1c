"""Adam-family optimisers whose geometry is meant to tolerate stale gradients (optax style).

`basis_rotation`: Adam in the eigenbasis of running averages of G G^T and G^T G per weight
matrix, after Jung, Shin and Lee, "Basis rotation for asynchronous pipeline training"
(ICML 2026, arXiv 2602.03515; their code's `--optimizer basisrotation --rotation_geometry bi
--approx_source 2nd`). Their argument: Adam's per-coordinate scaling assumes the loss's
curvature is aligned with the coordinate axes; when it is not, Adam oscillates along the top
eigendirections, and an update several steps old can point away from the current one.
Rotating each weight matrix into the eigenbasis of its gradient covariances aligns them.

`nadam_warmup`: PyTorch's NAdam (Dozat 2016) with its momentum warm-up, the optimiser of the
public code of PipeNAG (Ajanthan et al., ICML 2025, arXiv 2505.01099: `torch.optim.NAdam`,
betas (0.99, 0.999), momentum_decay 0.004, decoupled weight decay 0.01). optax's `nadam`
has no warm-up; with b1 = 0.99 the warm-up matters: mu_t = b1 (1 - 0.5 * 0.96^(t psi)) is
0.50 at the first step, 0.57 after 1k steps and 0.89 after 10k.

Both are plain `optax.GradientTransformation`s (updates include -learning_rate); under a
delayed schedule they are used as the stage's optimiser (`fdg_jax.optim.make_optimizer`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


def _lr(learning_rate, count):
  return learning_rate(count) if callable(learning_rate) else learning_rate


# --------------------------------------------------------------------------------------------
# Basis rotation


class BasisRotationState(NamedTuple):
  count: jax.Array  # int32: updates applied so far
  mu: Any           # first moment, in the weights' own coordinates
  nu: Any           # second moment, in the rotated coordinates (plain Adam's for other leaves)
  left: Any         # per rotated leaf: EMA of G G^T [m, m] (or () for a side not rotated)
  right: Any        # EMA of G^T G [n, n] (or ())
  q_left: Any       # the left eigenbasis [m, m] (or ())
  q_right: Any      # the right eigenbasis [n, n] (or ())


def rotated_shape(shape, max_dim: int) -> Optional[tuple[int, int, bool, bool]]:
  """How `basis_rotation` treats a leaf of `shape`: None (plain Adam), or (m, n, rotate left,
  rotate right) for the matrix [m, n] it is viewed as.

  A leaf of rank >= 2 is a matrix of its last axis against the others (a Dense kernel
  [in, out] as it is; a convolution kernel [h, w, in, out] as [h*w*in, out]). A side is
  rotated if its size lies in [2, max_dim] (a larger one would cost max_dim^2 memory and an
  eigendecomposition of that size; it keeps the identity, as SOAP does). Vectors (biases,
  norms' scales) and leaves with no side rotated are plain Adam.
  """
  if len(shape) < 2:
    return None
  m, n = math.prod(shape[:-1]), shape[-1]
  left, right = 2 <= m <= max_dim, 2 <= n <= max_dim
  return (m, n, left, right) if left or right else None


def _eig_descending(a):
  """Eigenvectors of the symmetric `a`, by decreasing eigenvalue."""
  _, vecs = jnp.linalg.eigh(a)
  return vecs[:, ::-1]


def _power_qr(stat, q, nu, axis):
  """One refresh of a basis (as SOAP): order q's columns by their estimated eigenvalues
  diag(q^T stat q), decreasing, permute nu's `axis` alike, then one power iteration and a QR
  factorisation. Returns (new q, nu)."""
  est = jnp.einsum("ij,ik,kj->j", q, stat, q)
  order = jnp.argsort(-est)
  q = q[:, order]
  nu = jnp.take(nu, order, axis=axis)
  q, _ = jnp.linalg.qr(stat @ q)
  return q, nu


def basis_rotation(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, shampoo_beta: Optional[float] = None,
                   frequency: int = 10, max_dim: int = 2048,
                   mask: Optional[Callable] = None) -> optax.GradientTransformation:
  """Adam in a rotated basis per weight matrix (bilateral, second-moment statistics).

  Per rotated leaf W, viewed as a matrix [m, n] (`rotated_shape`), with gradient G and step
  t = 1, 2, ...:
    L <- s L + (1 - s) G G^T,  R <- s R + (1 - s) G^T G      (s = shampoo_beta, default b2)
    at t = 1: Q_L, Q_R = the eigenvectors of L, R (by decreasing eigenvalue);
    every `frequency` steps after: one power-iteration step and a QR per side (`_power_qr`);
    m <- b1 m + (1 - b1) G                                    (kept in W's coordinates)
    G~ = Q_L^T G Q_R,  M~ = Q_L^T m Q_R,  v <- b2 v + (1 - b2) G~^2   (v in the rotated ones)
    W <- W - lr wd W - lr sqrt(1 - b2^t) / (1 - b1^t) Q_L (M~ / (sqrt(v) + eps)) Q_R^T.
  The statistics include the current gradient, and the first step already uses the basis
  built from it. When a basis changes, m needs nothing (it lives in W's coordinates) and v
  is kept (only permuted with the eigenvalue order). Other leaves (vectors, and those `mask`
  marks False) get the same Adam without rotation: plain AdamW (decoupled weight decay).

  Args:
    learning_rate: a float or an optax schedule of the update count.
    b1, b2, eps: Adam's; weight_decay: decoupled, scaled by the learning rate (AdamW).
    shampoo_beta: the statistics' decay (None: b2, as the paper's runs).
    frequency: steps between refreshes of the bases (the paper: 10).
    max_dim: the largest side that is rotated.
    mask: optional `params -> pytree of bools`, True for the leaves to rotate (e.g. to keep
      embeddings plain, as the paper does); leaves it marks False are plain AdamW.

  Memory per rotated matrix [m, n]: L, R, Q_L, Q_R (2 m^2 + 2 n^2) on top of Adam's 2 m n.
  """
  if frequency < 1:
    raise ValueError(f"basis_rotation's frequency must be >= 1, got {frequency}")
  s_beta = b2 if shampoo_beta is None else shampoo_beta

  def leaves_of(tree):
    """`tree`'s leaves, each one's `rotated_shape` (None where `mask` says plain), treedef."""
    flat, treedef = jax.tree.flatten(tree)
    kinds = [rotated_shape(p.shape, max_dim) for p in flat]
    if mask is not None:
      chosen = treedef.flatten_up_to(mask(tree))
      kinds = [k if c else None for k, c in zip(kinds, chosen)]
    return flat, kinds, treedef

  def init_fn(params):
    flat, ks, treedef = leaves_of(params)
    mu = [jnp.zeros_like(p) for p in flat]
    nu, left, right, ql, qr = [], [], [], [], []
    for p, kind in zip(flat, ks):
      if kind is None:
        nu.append(jnp.zeros_like(p))
        left.append(()), right.append(()), ql.append(()), qr.append(())
        continue
      m, n, rot_l, rot_r = kind
      nu.append(jnp.zeros((m, n), p.dtype))
      left.append(jnp.zeros((m, m), p.dtype) if rot_l else ())
      right.append(jnp.zeros((n, n), p.dtype) if rot_r else ())
      ql.append(jnp.eye(m, dtype=p.dtype) if rot_l else ())
      qr.append(jnp.eye(n, dtype=p.dtype) if rot_r else ())
    un = lambda xs: treedef.unflatten(xs)
    return BasisRotationState(jnp.zeros([], jnp.int32), un(mu), un(nu), un(left), un(right),
                              un(ql), un(qr))

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("basis_rotation with weight_decay needs the params in update")
    count = optax.safe_int32_increment(state.count)
    t = count.astype(jnp.float32)
    lr = _lr(learning_rate, state.count)
    step = lr * jnp.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
    cold, warm = count == 1, count % frequency == 0
    flat_g, ks, treedef = leaves_of(updates)
    fl = lambda tree: treedef.flatten_up_to(tree)
    flat_p = fl(params) if params is not None else [None] * len(flat_g)
    out = {name: [] for name in ("u", "mu", "nu", "left", "right", "ql", "qr")}
    for g, p, kind, mu, nu, L, R, QL, QR in zip(flat_g, flat_p, ks, fl(state.mu), fl(state.nu),
                                               fl(state.left), fl(state.right),
                                               fl(state.q_left), fl(state.q_right)):
      mu = b1 * mu + (1.0 - b1) * g
      if kind is None:  # plain AdamW
        nu = b2 * nu + (1.0 - b2) * g * g
        direction = mu / (jnp.sqrt(nu) + eps)
      else:
        m, n, rot_l, rot_r = kind
        G, M = g.reshape(m, n), mu.reshape(m, n)
        if rot_l:
          L = s_beta * L + (1.0 - s_beta) * (G @ G.T)
        if rot_r:
          R = s_beta * R + (1.0 - s_beta) * (G.T @ G)

        def refresh(QL, QR, nu, L=L, R=R, rot_l=rot_l, rot_r=rot_r):
          def on_cold(QL, QR, nu):
            return (_eig_descending(L) if rot_l else QL), (_eig_descending(R) if rot_r
                                                           else QR), nu

          def on_warm(QL, QR, nu):
            if rot_l:
              QL, nu = _power_qr(L, QL, nu, 0)
            if rot_r:
              QR, nu = _power_qr(R, QR, nu, 1)
            return QL, QR, nu

          return jax.lax.cond(cold, on_cold,
                              lambda *a: jax.lax.cond(warm, on_warm, lambda *b: b, *a),
                              QL, QR, nu)

        QL, QR, nu = refresh(QL, QR, nu)
        def rot(X, QL=QL, QR=QR, rot_l=rot_l, rot_r=rot_r):  # Q_L^T X Q_R
          X = QL.T @ X if rot_l else X
          return X @ QR if rot_r else X

        Gt, Mt = rot(G), rot(M)
        nu = b2 * nu + (1.0 - b2) * Gt * Gt
        D = Mt / (jnp.sqrt(nu) + eps)
        D = QL @ D if rot_l else D
        D = D @ QR.T if rot_r else D
        direction = D.reshape(g.shape)
      u = -step * direction
      if weight_decay:
        u = u - lr * weight_decay * p
      for name, value in zip(("u", "mu", "nu", "left", "right", "ql", "qr"),
                             (u.astype(g.dtype), mu, nu, L, R, QL, QR)):
        out[name].append(value)
    un = treedef.unflatten
    return un(out["u"]), BasisRotationState(count, un(out["mu"]), un(out["nu"]),
                                            un(out["left"]), un(out["right"]), un(out["ql"]),
                                            un(out["qr"]))

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# NAdam with PyTorch's momentum warm-up (PipeNAG's optimiser)


class NadamWarmupState(NamedTuple):
  count: jax.Array       # int32: updates applied so far
  mu_product: jax.Array  # float32: prod_{i <= t} mu_i
  m: Any
  v: Any


def nadam_warmup(learning_rate, b1: float = 0.99, b2: float = 0.999, eps: float = 1e-8,
                 momentum_decay: float = 0.004,
                 weight_decay: float = 0.01) -> optax.GradientTransformation:
  """PyTorch's NAdam (decoupled weight decay), the optimiser of PipeNAG's public code.

  At step t = 1, 2, ... with psi = momentum_decay:
    mu_t = b1 (1 - 0.5 * 0.96^(t psi)),  mu_{t+1} likewise,  P_t = prod_{i <= t} mu_i
    m <- b1 m + (1 - b1) g,  v <- b2 v + (1 - b2) g^2,  d = sqrt(v / (1 - b2^t)) + eps
    theta <- theta (1 - lr wd) - lr (1 - mu_t) / (1 - P_t) g / d
                               - lr mu_{t+1} / (1 - P_t mu_{t+1}) m / d
  Defaults are PipeNAG's (b1 0.99, weight decay 0.01).
  """
  def mu_at(t):
    return b1 * (1.0 - 0.5 * jnp.power(0.96, t * momentum_decay))

  def init_fn(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return NadamWarmupState(jnp.zeros([], jnp.int32), jnp.ones([], jnp.float32), zeros,
                            jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("nadam_warmup with weight_decay needs the params in update")
    count = optax.safe_int32_increment(state.count)
    t = count.astype(jnp.float32)
    lr = _lr(learning_rate, state.count)
    mu, mu_next = mu_at(t), mu_at(t + 1.0)
    product = state.mu_product * mu
    m = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.m, updates)
    v = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * g * g, state.v, updates)
    c_grad = lr * (1.0 - mu) / (1.0 - product)
    c_mom = lr * mu_next / (1.0 - product * mu_next)
    bias2 = 1.0 - b2 ** t

    def step(g, m, v, p):
      denom = jnp.sqrt(v / bias2) + eps
      u = -c_grad * g / denom - c_mom * m / denom
      if weight_decay:
        u = u - lr * weight_decay * p
      return u.astype(g.dtype)

    ps = params if params is not None else jax.tree.map(lambda g: None, updates)
    new = jax.tree.map(step, updates, m, v, ps, is_leaf=lambda x: x is None)
    return new, NadamWarmupState(count, product, m, v)

  return optax.GradientTransformation(init_fn, update_fn)
