"""Transformers (vit, gpt): shapes, causality, split == unsplit, FDG training, registry."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fdg_jax
from fdg_jax import models, partition
from fdg_jax.models.transformer import lm_loss

SMALL = dict(dim=16, depth=3, num_heads=2, mlp_ratio=2.0)


def small_gpt(**kw):
  return models.create("gpt", num_classes=32, seq_len=8, **{**SMALL, **kw})


def small_vit(**kw):
  return models.create("vit", num_classes=10, input_shape=(8, 8, 1), patch_size=2,
                       **{**SMALL, **kw})


def init_full(model, x):
  return model.module().init(jax.random.key(0), x, train=False)


def tokens(shape, seed=0, vocab=32):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


def test_shapes_and_blocks():
  g = small_gpt()
  assert g.num_blocks == 1 + 3 + 1 and g.block_names[0] == "embed" and g.block_names[-1] == "head"
  assert g.input_dtype == "int32" and g.example_input(2).shape == (2, 8)
  assert g.example_input(2).dtype == jnp.int32 and g.num_classes == 32
  x = tokens((2, 8))
  v = init_full(g, x)
  assert g.module().apply(v, x, train=False).shape == (2, 8, 32)
  assert g.module().apply(v, x[:, :5], train=False).shape == (2, 5, 32)  # shorter than seq_len
  for pool in ("mean", "cls"):
    m = small_vit(pool=pool)
    assert m.example_input(3).dtype == jnp.float32
    xi = jax.random.normal(jax.random.key(1), (3, 8, 8, 1))
    v = init_full(m, xi)
    infos = partition.block_info(m, m.example_input(3))
    assert infos[0].output.shape == (3, 16 + (pool == "cls"), 16)  # 4x4 patches of 2x2
    assert m.module().apply(v, xi, train=False).shape == (3, 10)
  # CIFAR-sized input, shape only.
  m = models.create("vit", input_shape=(32, 32, 3), **SMALL)
  assert partition.block_info(m, m.example_input(1))[-1].output.shape == (1, 10)


def test_causal_masking():
  g = small_gpt()
  x = tokens((2, 8))
  v = init_full(g, x)
  f = jax.jit(lambda x: g.module().apply(v, x, train=False))
  y = f(x)
  for t in (0, 3, 6):
    x2 = x.at[:, t + 1:].set((x[:, t + 1:] + 7) % 32)
    y2 = f(x2)
    np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], atol=1e-6)
    assert not np.allclose(y2[:, t + 1:], y[:, t + 1:])


@pytest.mark.parametrize("name,K", [("gpt", 2), ("gpt", 3), ("vit", 2)])
def test_split_equals_unsplit(name, K):
  m = small_gpt() if name == "gpt" else small_vit(pool="cls")
  x = tokens((2, 8)) if name == "gpt" else jax.random.normal(jax.random.key(2), (2, 8, 8, 1))
  how = "balanced" if K == 2 else "uniform"
  bounds = partition.boundaries(m, K, how, example_input=m.example_input(2))
  assert len(bounds) == K - 1
  stages = partition.stages_from_boundaries(m, bounds)
  params, states = fdg_jax.init_stages(stages, jax.random.key(0), x)
  y, _ = fdg_jax.forward(stages, params, states, x, train=False)
  merged = partition.merge_trees(params)
  y_full = m.module().apply({"params": merged}, x, train=False)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_full), atol=1e-5)
  # Stage variables are sub-dicts of the unsplit model's: same structure.
  full = init_full(m, x)["params"]
  assert jax.tree.structure(merged) == jax.tree.structure(full)


def test_balanced_split_of_token_model():
  g = small_gpt(depth=4)
  costs = partition.block_costs(g, g.example_input(1))
  assert costs.shape == (6,) and (costs > 0).all()
  assert partition.boundaries(g, 3, "uniform") == [2, 4]
  b = partition.boundaries(g, 3, "balanced", example_input=g.example_input(1))
  assert len(b) == 2 and 0 < b[0] < b[1] < 6


def fdg_steps(dropout):
  K = 2
  g = small_gpt(dropout=dropout)
  x1 = g.example_input(1)
  stages = partition.split(g, K, "uniform", example_input=x1)
  params, states = fdg_jax.init_stages(stages, jax.random.key(0), jnp.zeros(x1.shape, x1.dtype))
  sched = fdg_jax.fdg(stages, lm_loss, optax.sgd(0.1))
  state = sched.init(params, states)
  # Learnable data: the next token is the current one plus one.
  start = np.random.default_rng(0).integers(0, 32, (6, 4, 1))
  seqs = (start + np.arange(9)) % 32
  losses = []
  for t in range(6):
    batch = (jnp.asarray(seqs[t, :, :-1], jnp.int32), jnp.asarray(seqs[t, :, 1:], jnp.int32))
    state, m = sched.step(state, batch)
    if "loss" in m:
      losses.append(float(m["loss"]))
      assert 0.0 <= float(m["accuracy"]) <= 1.0  # default metrics: per-token accuracy
  assert len(losses) == 6 - (K - 1)
  assert np.all(np.isfinite(losses))
  final = sched.params(state)
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(final))
  assert not np.allclose(final[0]["block_0"]["tokens"]["embedding"],
                         params[0]["block_0"]["tokens"]["embedding"])


def test_fdg_training_on_tokens():
  fdg_steps(dropout=0.0)


def test_fdg_training_on_tokens_with_dropout():
  fdg_steps(dropout=0.1)


def test_dropout_in_training_forward():
  g = small_gpt(dropout=0.5)
  stages = partition.split(g, 2, "uniform")
  x = tokens((2, 8))
  params, states = fdg_jax.init_stages(stages, jax.random.key(0), x)
  fwd = lambda train, rng: fdg_jax.forward(stages, params, states, x, train=train, rng=rng)[0]
  a, b, c = fwd(True, jax.random.key(1)), fwd(True, jax.random.key(1)), fwd(True, jax.random.key(2))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  np.testing.assert_allclose(fwd(False, None), fwd(False, jax.random.key(3)), atol=0)


def test_lm_loss_mask():
  logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
  y = jnp.array([[0, 1, 2], [3, 4, 0]])
  full = lm_loss(logits, y)
  assert np.isclose(lm_loss(logits, y, jnp.ones(2)), full)
  assert np.isclose(lm_loss(logits, y, jnp.array([1.0, 0.0])), lm_loss(logits[:1], y[:1]))
  np.testing.assert_allclose(
      lm_loss(logits, y, jnp.array([[1.0, 1, 0], [0, 0, 0]])), lm_loss(logits[:1, :2], y[:1, :2]),
      rtol=1e-6)


def test_registry_and_errors():
  for name in ("vit", "vit_tiny", "gpt", "gpt_tiny"):
    assert name in models.names()
  assert models.create("gpt_tiny").num_classes == 256  # vocabulary: bytes
  assert models.create("gpt_tiny", num_classes=100).num_classes == 100
  assert models.create("gpt", depth=2).num_blocks == 4
  assert models.create("mlp").num_classes == 10  # unchanged default
  with pytest.raises(ValueError, match="tie_embeddings"):
    models.create("gpt", tie_embeddings=True)
  with pytest.raises(ValueError, match="num_heads"):
    models.create("gpt", dim=30, num_heads=4)
  with pytest.raises(ValueError, match="divisible"):
    models.create("vit", input_shape=(8, 8, 1), patch_size=3)
  with pytest.raises(ValueError, match="options are"):
    models.create("vit", vocab=3)
  g = small_gpt()
  with pytest.raises(ValueError, match="seq_len"):
    jax.eval_shape(lambda x: init_full(g, x), jax.ShapeDtypeStruct((1, 9), jnp.int32))
  with pytest.raises(ValueError, match="integer tokens"):
    jax.eval_shape(lambda x: init_full(g, x), jax.ShapeDtypeStruct((1, 8), jnp.float32))


@pytest.mark.parametrize("name,expected", [
    ("gpt_tiny", 875_520), ("gpt", 4_935_936), ("vit_tiny", 5_362_378), ("vit", 2_693_194)])
def test_preset_param_counts(name, expected):
  m = models.create(name)
  n = sum(partition.param_count(i.params) for i in partition.block_info(m, m.example_input(1)))
  assert n == expected


def test_summary_cli_token_model(capsys):
  from fdg_jax.summary import main
  assert main(["--model", "gpt", "--num-stages", "2", "--split", "uniform", "--json",
               "--model-kwargs", '{"depth": 2, "dim": 16, "num_heads": 2, "seq_len": 8}']) == 0
  s = json.loads(capsys.readouterr().out)
  assert s["boundaries"] == [2] and s["stages"][0]["first"] == "embed"
  # vocab 256 by default: embedding 256*16 + positions 8*16 in stage 0.
  assert s["stages"][1]["params"] > 256 * 16
  assert main(["--model", "gpt", "--num-stages", "2", "--model-kwargs", "[1]"]) == 2
