"""Tiny hand-written stages shared by the schedule tests (pure functions, no library code).

Each `apply(params, model_state, x, *, train, rng=None) -> (y, model_state)`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

WIDTH = 6
NUM_CLASSES = 4


def dense_apply(params, model_state, x, *, train=True, rng=None):
  del train, rng
  return jnp.tanh(x @ params["w"] + params["b"]), model_state


def bn_dense_apply(params, model_state, x, *, train=True, rng=None):
  """Dense -> BatchNorm (batch statistics in training, running ones in eval) -> tanh."""
  del rng
  z = x @ params["w"]
  if train:
    mean, var = z.mean(0), z.var(0)
    model_state = {"mean": 0.9 * model_state["mean"] + 0.1 * mean,
                   "var": 0.9 * model_state["var"] + 0.1 * var}
  else:
    mean, var = model_state["mean"], model_state["var"]
  z = (z - mean) / jnp.sqrt(var + 1e-5) * params["scale"] + params["bias"]
  return jnp.tanh(z), model_state


def head_apply(params, model_state, x, *, train=True, rng=None):
  del train, rng
  return x @ params["w"] + params["b"], model_state


def loss_fn(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_model(kind: str, num_stages: int, seed: int = 0):
  """Returns (applies, params, model_states) of a K-stage toy model ('mlp' or 'bn')."""
  rng = np.random.RandomState(seed)
  applies, params, states = [], [], []
  for k in range(num_stages):
    last = k == num_stages - 1
    out = NUM_CLASSES if last else WIDTH
    w = jnp.asarray(rng.randn(WIDTH, out) / np.sqrt(WIDTH), jnp.float32)
    if last:
      applies.append(head_apply)
      params.append({"w": w, "b": jnp.zeros(out)})
      states.append({})
    elif kind == "bn":
      applies.append(bn_dense_apply)
      params.append({"w": w, "scale": jnp.ones(out), "bias": jnp.zeros(out)})
      states.append({"mean": jnp.zeros(out), "var": jnp.ones(out)})
    else:
      applies.append(dense_apply)
      params.append({"w": w, "b": jnp.asarray(rng.randn(out) * 0.1, jnp.float32)})
      states.append({})
  return applies, params, states


def batches(num: int, batch_size: int = 8, seed: int = 1):
  rng = np.random.RandomState(seed)
  return [(jnp.asarray(rng.randn(batch_size, WIDTH), jnp.float32),
           jnp.asarray(rng.randint(0, NUM_CLASSES, batch_size), jnp.int32))
          for _ in range(num)]


def assert_trees_close(a, b, atol):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)
