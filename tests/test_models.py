"""Models: parameter counts against the published ones, the registry, block structure.

Everything is shape-only (`jax.eval_shape`) except a few tiny forwards.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fdg_jax import models, partition


def full_param_count(model, x=None):
  """Parameters of the unsplit module, from an eval_shape'd init (nothing allocated)."""
  x = model.example_input(1) if x is None else x
  v = jax.eval_shape(lambda x: model.module().init(jax.random.key(0), x, train=False), x)
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(v["params"]))


# Published sizes (FDG paper table / He et al. 2016 / Zagoruyko & Komodakis 2016).
@pytest.mark.parametrize("name,target", [
    ("resnet20", 0.27e6), ("resnet56", 0.85e6), ("resnet110", 1.73e6),
    ("resnet18", 11.17e6), ("wrn28_10", 36.48e6)])
def test_param_counts_match_published(name, target):
  n = full_param_count(models.create(name, num_classes=10))
  assert abs(n - target) / target < 0.01, (name, n)


def test_param_counts_exact():
  # Exact counts of the standard implementations (option-A CIFAR ResNets; torchvision
  # ResNet-18/50 on ImageNet), pinning the architecture beyond the 1% band.
  assert full_param_count(models.create("resnet20")) == 269_722
  assert full_param_count(models.create("resnet20", shortcut="B")) == 272_474
  m = models.create("resnet18", num_classes=1000, stem="imagenet")
  assert full_param_count(m, m.example_input(1)) == 11_689_512


def test_resnet1202_by_shape_only():
  m = models.create("resnet1202")
  assert m.num_blocks == 1 + 3 * 200 + 1
  # Per-block shapes (7 distinct block configurations, cached), not a 602-block trace.
  n = sum(partition.param_count(i.params) for i in partition.block_info(m, m.example_input(1)))
  assert abs(n - 19.4e6) / 19.4e6 < 0.01, n


def test_block_info_agrees_with_whole_model():
  m = models.create("resnet20")
  infos = partition.block_info(m, m.example_input(2))
  assert sum(partition.param_count(i.params) for i in infos) == full_param_count(m)
  assert infos[0].output.shape == (2, 32, 32, 16)
  assert infos[-2].output.shape == (2, 8, 8, 64)
  assert infos[-1].output.shape == (2, 10)


def test_imagenet_stem_shapes():
  m = models.create("resnet50", num_classes=1000, stem="imagenet")
  assert m.input_shape == (224, 224, 3)
  infos = partition.block_info(m, m.example_input(1))
  assert infos[0].output.shape == (1, 56, 56, 64)   # 7x7/2 conv, then 3x3/2 max-pool
  assert infos[-1].output.shape == (1, 1000)
  assert models.create("resnet18").blocks[0].kind == "cifar"


@pytest.mark.parametrize("name", models.names())
def test_every_block_takes_train(name):
  kw = {"depth": 10, "width": 1} if name == "wrn" else {}
  m = models.create(name, **kw)
  assert m.name and len(m.block_names) == m.num_blocks
  assert m.block_names[-1] == "head"
  for b in m.blocks:
    params = inspect.signature(type(b).__call__).parameters
    assert list(params)[:3] == ["self", "x", "train"], (name, type(b).__name__)


def test_paper_splits():
  # docs/algorithms.md, "Splits used by the FDG reference code" (block 0 = stem / conv1).
  assert models.create("resnet56").paper_splits == {2: (14,), 4: (7, 14, 21)}
  assert models.create("resnet110").paper_splits == {4: (14, 28, 42)}
  assert models.create("wrn28_10").paper_splits == {2: (7,)}
  assert models.create("resnet20").paper_splits == {}
  m = models.create("resnet56")
  assert [m.block_names[b] for b in m.paper_splits[4]] == ["layer1.6", "layer2.4", "layer3.2"]
  assert models.create("wrn28_10").block_names[7] == "layer2.2"


def test_registry_errors():
  with pytest.raises(ValueError, match="unknown model 'resnet21'.*resnet20"):
    models.create("resnet21")
  with pytest.raises(ValueError, match="options are: .*shortcut"):
    models.create("resnet20", stem="imagenet")
  with pytest.raises(ValueError, match="shortcut"):
    models.create("resnet20", shortcut="C")
  with pytest.raises(ValueError, match="6n\\+4"):
    models.create("wrn", depth=12, width=2)
  assert "resnet1202" in models.names() and "wrn28_10" in models.names()


def test_wrn_by_name_and_dropout():
  m = models.create("wrn16_4", dropout=0.3)
  assert m.name == "wrn16_4" and m.num_blocks == 1 + 3 * 2 + 1
  small = models.create("wrn", depth=10, width=1, dropout=0.5)
  mod = small.module()
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  struct = jax.eval_shape(lambda x: mod.init(jax.random.key(1), x, train=False), x)
  # Variables without compiling an init: ones (running variances must be positive).
  v = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype), struct)

  def run(key):
    y_train = mod.apply(v, x, train=True, mutable=["batch_stats"], rngs={"dropout": key})[0]
    return y_train, mod.apply(v, x, train=False)

  # Backend optimisations off: half the CPU compile time, same semantics.
  run = jax.jit(run).lower(jax.random.key(0)).compile({"xla_backend_optimization_level": 0})
  (a, eval_a), (b, eval_b), (c, _) = run(jax.random.key(0)), run(jax.random.key(0)), run(
      jax.random.key(1))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  np.testing.assert_array_equal(eval_a, eval_b)


def test_batch_stats_are_model_state():
  m = models.create("resnet20")
  v = jax.eval_shape(lambda x: m.module().init(jax.random.key(0), x, train=False),
                     m.example_input(1))
  assert set(v) == {"params", "batch_stats"}
  assert v["batch_stats"]["block_0"]["BatchNorm_0"]["mean"].shape == (16,)
  assert set(jax.eval_shape(lambda x: models.create("mlp").module().init(
      jax.random.key(0), x, train=False), jnp.zeros((1, 32, 32, 3)))) == {"params"}
