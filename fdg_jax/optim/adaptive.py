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
delayed schedule they are used as the stage's optimiser (`fdg_jax.optim.make_optimizer`
names them), not as a correction chained to one (those are `fdg_jax.optim.remedies`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fdg_jax.optim.cpu_lapack import one_at_a_time_on_cpu, single_threaded_scipy_blas


def _lr(learning_rate, count):
  return learning_rate(count) if callable(learning_rate) else learning_rate


# --------------------------------------------------------------------------------------------
# Basis rotation


class BasisRotationState(NamedTuple):
  """The state of `basis_rotation`."""
  count: jax.Array  # int32: updates applied so far
  mu: Any           # first moment per leaf, in the leaf's own coordinates
  nu: Any           # second moment: per plain leaf; per group [B, m, n] in the rotated basis
  left: Any         # per group: EMA of G G^T [B, m, m] (() where the left side is not rotated)
  right: Any        # per group: EMA of G^T G [B, n, n] (())
  q_left: Any       # per group: the left eigenbases [B, m, m] (())
  q_right: Any      # per group: the right eigenbases [B, n, n] (())


def matrix_view(shape, max_dim: int = 2048) -> Optional[tuple[int, int, bool, bool]]:
  """The matrix [m, n] `basis_rotation` views a weight of `shape` as, and which sides it
  rotates: (m, n, left, right), or None (plain Adam).

  Rank 2: [in, out] itself. Rank 3 (a multi-head projection, [in, heads, dim] or [heads, dim,
  out]): the split of the axes into two groups that is closest to square, [in, heads*dim] or
  [heads*dim, out]. Rank 4 and more (a convolution [h, w, in, out]): [h*w*in, out]. A side is
  rotated if its size lies in [2, max_dim] (a larger one would cost max_dim^2 memory and an
  eigendecomposition of that size; it keeps the identity, as SOAP does). Vectors, and
  matrices with no side rotated, are plain Adam.
  """
  if len(shape) < 2:
    return None
  if len(shape) == 3:
    splits = [(math.prod(shape[:i]), math.prod(shape[i:])) for i in (1, 2)]
    m, n = min(splits, key=lambda mn: abs(math.log(mn[0] / mn[1])))
  else:
    m, n = math.prod(shape[:-1]), shape[-1]
  left, right = 2 <= m <= max_dim, 2 <= n <= max_dim
  return (m, n, left, right) if left or right else None


def default_rotation_mask(params):
  """Which leaves `basis_rotation` rotates by default: Flax's weight matrices (leaves named
  "kernel": Dense, DenseGeneral, Conv), so that embeddings, biases and norms stay plain AdamW
  as in the paper's code; in a pytree with no leaf named "kernel", every leaf of rank >= 2."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  named = [bool(path) and getattr(path[-1], "key", None) == "kernel" for path, _ in flat]
  if not any(named):
    named = [np.ndim(leaf) >= 2 for _, leaf in flat]
  return jax.tree.unflatten(treedef, named)


def _eig_descending(a):
  """Eigenvectors of the symmetric matrices `a` [B, m, m], by decreasing eigenvalue."""
  vecs = one_at_a_time_on_cpu(lambda a: jnp.linalg.eigh(a)[1], a)
  return vecs[..., ::-1]


def _power_qr(stat, q, nu, axis):
  """One refresh of the bases (as SOAP): order q's columns by their estimated eigenvalues
  diag(q^T stat q), decreasing, permute nu's `axis` (1: rows, 2: columns) alike, then one
  power iteration and a QR factorisation. All [B, ...]. Returns (new q, nu)."""
  est = jnp.einsum("bij,bik,bkj->bj", q, stat, q)
  order = jnp.argsort(-est, axis=-1)
  q = jnp.take_along_axis(q, order[:, None, :], axis=2)
  nu = jnp.take_along_axis(nu, order[:, :, None] if axis == 1 else order[:, None, :], axis=axis)
  q = one_at_a_time_on_cpu(lambda a: jnp.linalg.qr(a)[0], stat @ q)
  return q, nu


def basis_rotation(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, shampoo_beta: Optional[float] = None,
                   frequency: int = 10, max_dim: int = 2048,
                   mask: Optional[Callable] = None) -> optax.GradientTransformation:
  """Adam in a rotated basis per weight matrix (bilateral, second-moment statistics).

  Per rotated leaf W, viewed as a matrix [m, n] (`matrix_view`), with gradient G and step
  t = 1, 2, ...::

    L <- s L + (1 - s) G G^T,  R <- s R + (1 - s) G^T G      (s = shampoo_beta, default b2)
    at t = 1: Q_L, Q_R = the eigenvectors of L, R (by decreasing eigenvalue);
    every `frequency` steps after: one power-iteration step and a QR per side (`_power_qr`);
    m <- b1 m + (1 - b1) G                                    (kept in W's coordinates)
    G~ = Q_L^T G Q_R,  M~ = Q_L^T m Q_R,  v <- b2 v + (1 - b2) G~^2   (v in the rotated ones)
    W <- W - lr wd W - lr sqrt(1 - b2^t) / (1 - b1^t) Q_L (M~ / (sqrt(v) + eps)) Q_R^T.

  The statistics include the current gradient, and the first step already uses the basis
  built from it. When a basis changes, m needs nothing (it lives in W's coordinates) and v
  is kept (only permuted with the eigenvalue order). Other leaves get the same Adam without
  rotation: plain AdamW (decoupled weight decay; eps added to sqrt(v), the bias correction
  folded into the step, as the paper's code does).

  Args:
    learning_rate: a float or an optax schedule of the update count.
    b1, b2, eps: Adam's; weight_decay: decoupled, scaled by the learning rate (AdamW).
    shampoo_beta: the statistics' decay (None: b2, as the paper's runs).
    frequency: steps between refreshes of the bases (the paper: 10).
    max_dim: the largest side that is rotated.
    mask: `params -> pytree of bools`, True for the leaves to rotate (default
      `default_rotation_mask`: Flax kernels, else every leaf of rank >= 2).

  Matrices of one view share their work: each group of them is stacked and decomposed by
  one batched eigh/QR. Memory per rotated matrix [m, n]: L, R, Q_L, Q_R (2 m^2 + 2 n^2) on top
  of Adam's 2 m n.
  """
  if frequency < 1:
    raise ValueError(f"basis_rotation's frequency must be >= 1, got {frequency}")
  s_beta = b2 if shampoo_beta is None else shampoo_beta
  choose = default_rotation_mask if mask is None else mask

  def layout(tree):
    """(leaves, treedef, each leaf's view or None, the groups: view -> leaf indices)."""
    flat, treedef = jax.tree.flatten(tree)
    chosen = treedef.flatten_up_to(choose(tree))
    views = [matrix_view(p.shape, max_dim) if c else None for p, c in zip(flat, chosen)]
    groups: dict = {}
    for i, v in enumerate(views):
      if v is not None:
        groups.setdefault(v, []).append(i)
    return flat, treedef, views, groups

  def init_fn(params):
    flat, treedef, views, groups = layout(params)
    mu = treedef.unflatten([jnp.zeros_like(p) for p in flat])
    nu_plain = [jnp.zeros_like(p) if v is None else () for p, v in zip(flat, views)]
    nu, left, right, ql, qr = [], [], [], [], []
    for (m, n, rot_l, rot_r), idx in groups.items():
      B, dt = len(idx), flat[idx[0]].dtype
      nu.append(jnp.zeros((B, m, n), dt))
      left.append(jnp.zeros((B, m, m), dt) if rot_l else ())
      right.append(jnp.zeros((B, n, n), dt) if rot_r else ())
      ql.append(jnp.broadcast_to(jnp.eye(m, dtype=dt), (B, m, m)) if rot_l else ())
      qr.append(jnp.broadcast_to(jnp.eye(n, dtype=dt), (B, n, n)) if rot_r else ())
    return BasisRotationState(jnp.zeros([], jnp.int32), mu, (nu_plain, nu), left, right, ql, qr)

  def update_fn(updates, state, params=None):
    if jax.default_backend() == "cpu":  # while tracing: see fdg_jax.optim.cpu_lapack
      single_threaded_scipy_blas()
    if weight_decay and params is None:
      raise ValueError("basis_rotation with weight_decay needs the params in update")
    count = optax.safe_int32_increment(state.count)
    t = count.astype(jnp.float32)
    lr = _lr(learning_rate, state.count)
    step = lr * jnp.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
    cold, warm = count == 1, count % frequency == 0
    flat_g, treedef, views, groups = layout(updates)
    mus = [b1 * m + (1.0 - b1) * g for m, g in zip(treedef.flatten_up_to(state.mu), flat_g)]
    nu_plain, nu_groups = state.nu
    directions: list = [None] * len(flat_g)
    new_plain = list(nu_plain)
    for i, v in enumerate(views):
      if v is None:
        new_plain[i] = b2 * nu_plain[i] + (1.0 - b2) * flat_g[i] * flat_g[i]
        directions[i] = mus[i] / (jnp.sqrt(new_plain[i]) + eps)
    new = {"nu": [], "left": [], "right": [], "ql": [], "qr": []}
    for j, ((m, n, rot_l, rot_r), idx) in enumerate(groups.items()):
      G = jnp.stack([flat_g[i].reshape(m, n) for i in idx])
      M = jnp.stack([mus[i].reshape(m, n) for i in idx])
      L, R, QL, QR, nu = (state.left[j], state.right[j], state.q_left[j], state.q_right[j],
                          nu_groups[j])
      if rot_l:
        L = s_beta * L + (1.0 - s_beta) * (G @ jnp.swapaxes(G, 1, 2))
      if rot_r:
        R = s_beta * R + (1.0 - s_beta) * (jnp.swapaxes(G, 1, 2) @ G)

      def on_cold(QL, QR, nu, L=L, R=R, rot_l=rot_l, rot_r=rot_r):
        return (_eig_descending(L) if rot_l else QL), (_eig_descending(R) if rot_r else QR), nu

      def on_warm(QL, QR, nu, L=L, R=R, rot_l=rot_l, rot_r=rot_r):
        if rot_l:
          QL, nu = _power_qr(L, QL, nu, 1)
        if rot_r:
          QR, nu = _power_qr(R, QR, nu, 2)
        return QL, QR, nu

      QL, QR, nu = jax.lax.cond(cold, on_cold,
                                lambda *a, w=on_warm: jax.lax.cond(warm, w, lambda *b: b, *a),
                                QL, QR, nu)

      def rotate(X, QL=QL, QR=QR, rot_l=rot_l, rot_r=rot_r):  # Q_L^T X Q_R
        X = jnp.swapaxes(QL, 1, 2) @ X if rot_l else X
        return X @ QR if rot_r else X

      Gt, Mt = rotate(G), rotate(M)
      nu = b2 * nu + (1.0 - b2) * Gt * Gt
      D = Mt / (jnp.sqrt(nu) + eps)
      D = QL @ D if rot_l else D
      D = D @ jnp.swapaxes(QR, 1, 2) if rot_r else D
      for b, i in enumerate(idx):
        directions[i] = D[b].reshape(flat_g[i].shape)
      for name, value in zip(("nu", "left", "right", "ql", "qr"), (nu, L, R, QL, QR)):
        new[name].append(value)
    flat_p = treedef.flatten_up_to(params) if params is not None else [None] * len(flat_g)
    out = []
    for g, d, p in zip(flat_g, directions, flat_p):
      u = -step * d
      if weight_decay:
        u = u - lr * weight_decay * p
      out.append(u.astype(g.dtype))
    return treedef.unflatten(out), BasisRotationState(
        count, treedef.unflatten(mus), (new_plain, new["nu"]), new["left"], new["right"],
        new["ql"], new["qr"])

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# NAdam with PyTorch's momentum warm-up (PipeNAG's optimiser)


class NadamWarmupState(NamedTuple):
  """The state of `nadam_warmup`."""
  count: jax.Array       # int32: updates applied so far
  mu_product: jax.Array  # float32: prod_{i <= t} mu_i
  m: Any
  v: Any


def nadam_warmup(learning_rate, b1: float = 0.99, b2: float = 0.999, eps: float = 1e-8,
                 momentum_decay: float = 0.004,
                 weight_decay: float = 0.01) -> optax.GradientTransformation:
  """PyTorch's NAdam (decoupled weight decay), the optimiser of PipeNAG's public code.

  At step t = 1, 2, ... with psi = momentum_decay::

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
