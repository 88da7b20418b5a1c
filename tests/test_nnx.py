"""NNX stages (`Stage.from_nnx`, `nnx_stages`) against the unsplit NNX model.

The reference is the plain NNX model: the same blocks (built again from the same seeds) held
in one `nnx.Module`, run with `nnx.value_and_grad` and updated with `nnx.update`, with dropout
keyed explicitly by `nnx.reseed`. It does not use the Stage machinery under test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fdg_jax
from fdg_jax.stages import Stage, forward, nnx_stages

TOL = dict(rtol=1e-5, atol=1e-6)
SPLITS = {1: [], 2: [2], 3: [1, 3]}   # K -> boundaries over the 4 blocks
LR = 0.1


class Dense(nnx.Module):
  def __init__(self, din, dout, rngs, *, norm=False, dropout=None):
    self.linear = nnx.Linear(din, dout, rngs=rngs)
    self.norm = nnx.BatchNorm(dout, momentum=0.9, rngs=rngs) if norm else None
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout is not None else None

  def __call__(self, x):
    x = self.linear(x)
    if self.norm is not None:
      x = self.norm(x)
    x = jax.nn.relu(x)
    return self.dropout(x) if self.dropout is not None else x


def make_blocks(dropout=0.3):
  """Four blocks: relu MLP with a BatchNorm block and a Dropout block; same seeds every call."""
  rngs = nnx.Rngs(params=0, dropout=1)
  return [Dense(6, 16, rngs), Dense(16, 16, rngs, norm=True), Dense(16, 16, rngs, dropout=dropout),
          nnx.Linear(16, 4, rngs=rngs)]


class Net(nnx.Module):
  """The unsplit reference model."""

  def __init__(self, blocks):
    self.blocks = nnx.List(blocks)

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return x


def ce(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data(seed=0, n=8):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return jax.random.normal(kx, (n, 6)), jax.random.randint(ky, (n,), 0, 4)


def close(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TOL), a, b)


def ref_blocks(tree, key="blocks"):
  """{block index: pure dict} of an unsplit-Net state (grads, params, batch stats)."""
  return {f"block_{i}": v for i, v in nnx.to_pure_dict(tree)[key].items() if jax.tree.leaves(v)}


def merged(per_stage):
  out = {}
  for d in per_stage:
    assert not set(d) & set(out)   # stages own disjoint blocks
    out.update(d)
  return out


def snapshot(tree):
  """Host copies of a pytree's arrays (PRNG keys as their key data)."""
  def host(a):
    if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
      a = jax.random.key_data(a)
    return np.array(a)
  return jax.tree.map(host, tree)


def stage_of(bounds, i):
  return sum(i >= b for b in bounds)


# ---------------------------------------------------------------------------- 1. equivalence
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("train", [False, True])
def test_split_equals_unsplit(K, train):
  x, y = data()
  bounds = SPLITS[K]
  stages = nnx_stages(make_blocks(), bounds)
  assert len(stages) == K
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
  net = Net(make_blocks())
  close(merged(params), ref_blocks(nnx.state(net, nnx.Param)))
  close(merged(states), ref_blocks(nnx.state(net, nnx.BatchStat)))
  assert jax.tree.leaves(merged(states))   # BatchNorm stats are the model state

  rng = jax.random.PRNGKey(7)

  def split_loss(params):
    out, new_states = forward(stages, params, states, x, train=train, rng=rng)
    return ce(out, y), (out, new_states)

  (loss, (out, new_states)), grads = jax.value_and_grad(split_loss, has_aux=True)(params)

  # Reference: `forward` keys stage k with fold_in(rng, k); block i of stage k draws its
  # dropout mask from fold_in(that, i).
  net.train() if train else net.eval()
  for i, b in enumerate(net.blocks):
    nnx.reseed(b, dropout=jax.random.fold_in(jax.random.fold_in(rng, stage_of(bounds, i)), i))

  def ref_loss(net):
    out = net(x)
    return ce(out, y), out

  (ref_l, ref_out), ref_grads = nnx.value_and_grad(ref_loss, has_aux=True)(net)
  np.testing.assert_allclose(out, ref_out, **TOL)
  np.testing.assert_allclose(loss, ref_l, **TOL)
  close(merged(grads), ref_blocks(ref_grads))
  # Train: batch statistics updated exactly as the unsplit model updates them; eval: as given.
  close(merged(new_states), ref_blocks(nnx.state(net, nnx.BatchStat)))
  if train:
    assert not np.allclose(merged(new_states)["block_1"]["norm"]["mean"],
                           merged(states)["block_1"]["norm"]["mean"])
    eval_out, _ = forward(stages, params, states, x, train=False)
    assert not np.allclose(out, eval_out)   # dropout and batch statistics are active


def test_dropout_keys_same_rng_per_stage():
  """Applying every stage with the same rng draws the masks of the unsplit block list."""
  x, _ = data()
  rng = jax.random.PRNGKey(3)
  blocks = make_blocks(dropout=0.5)
  whole = Stage.from_nnx(blocks)
  p, s = whole.init(None, x)
  ref, _ = whole.apply(p, s, x, train=True, rng=rng)
  for K, bounds in SPLITS.items():
    stages = nnx_stages(make_blocks(dropout=0.5), bounds)
    h = x
    for st in stages:
      p, s = st.init(None, h)
      h, _ = st.apply(p, s, h, train=True, rng=rng)
    np.testing.assert_allclose(h, ref, **TOL)
  other, _ = whole.apply(*whole.init(None, x), x, train=True, rng=jax.random.PRNGKey(4))
  assert not np.allclose(other, ref)


def test_single_module_and_layout():
  m = nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(1)))
  st = Stage.from_nnx(m)
  assert st.name == "Sequential"
  params, state = st.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
  assert state == {}
  assert set(jax.tree.leaves(jax.tree.map(lambda a: a.dtype, params))) == {jnp.dtype("float32")}
  x = jnp.ones((4, 3))
  y1, s1 = st.apply(params, state, x, train=True, rng=jax.random.PRNGKey(1))
  y2, _ = st.apply(params, state, x, train=True, rng=jax.random.PRNGKey(1))
  y3, _ = st.apply(params, state, x, train=True, rng=jax.random.PRNGKey(2))
  ye, _ = st.apply(params, state, x, train=False)
  assert s1 == {}
  np.testing.assert_array_equal(y1, y2)
  assert not np.array_equal(y1, y3)
  np.testing.assert_allclose(ye, x @ params["layers"][0]["kernel"] + params["layers"][0]["bias"],
                             **TOL)
  # Plain callables are allowed in a block list and own nothing.
  st2 = nnx_stages([nnx.Linear(3, 5, rngs=nnx.Rngs(0)), jax.nn.relu, jnp.tanh], 2)
  assert [s.name for s in st2] == ["nnx[0:1]", "nnx[1:3]"]
  assert st2[1].init(None, x) == ({}, {})
  with pytest.raises(ValueError):
    nnx_stages(make_blocks(), [2, 1])
  with pytest.raises(ValueError):
    nnx_stages(make_blocks(), [0])


# ---------------------------------------------------------------------------- 2. schedules
def test_bp_equals_manual_sgd():
  """5 BP ticks over 3 NNX stages == 5 SGD steps of the unsplit NNX model (dropout rate 0, so
  no key derivation is involved; BatchNorm runs in training mode)."""
  T = 5
  batches = [data(seed=t) for t in range(T)]
  stages = nnx_stages(make_blocks(dropout=0.0), SPLITS[3])
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), batches[0][0])
  sched = fdg_jax.bp(stages, ce, optax.sgd(LR))
  state = sched.init(params, states)
  losses = []
  for b in batches:
    state, m = sched.step(state, b)
    losses.append(float(m["loss"]))

  net = Net(make_blocks(dropout=0.0))
  net.train()
  ref_losses = []
  for x, y in batches:
    loss, g = nnx.value_and_grad(lambda n: ce(n(x), y))(net)
    p = nnx.state(net, nnx.Param)
    nnx.update(net, jax.tree.map(lambda a, b: a - LR * b, p, g))
    ref_losses.append(float(loss))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  close(merged(sched.params(state)), ref_blocks(nnx.state(net, nnx.Param)))
  close(merged(sched.model_states(state)), ref_blocks(nnx.state(net, nnx.BatchStat)))


@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
def test_schedules_train(algorithm):
  x, y = data(seed=1, n=16)
  blocks = make_blocks()
  stages = nnx_stages(blocks, 3)
  params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
  before = snapshot(nnx.to_pure_dict(nnx.state(Net(blocks))))
  first = snapshot(params)
  sched = fdg_jax.create(algorithm, stages, ce, optax.sgd(0.05))
  state = sched.init(params, states)
  losses = []
  for _ in range(40):
    state, m = sched.step(state, (x, y))
    if m.get("loss") is not None:
      losses.append(float(m["loss"]))
  new = sched.params(state)
  assert all(np.isfinite(a).all() for a in jax.tree.leaves(new))
  assert all(np.isfinite(a).all() for a in jax.tree.leaves(sched.model_states(state)))
  for k in range(3):   # every stage's weights moved
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(new[k]),
                                                          jax.tree.leaves(first[k]))) > 1e-4
  assert np.mean(losses[-5:]) < np.mean(losses[:5])
  # The schedule donates its state; the modules the stages were made from are untouched.
  jax.tree.map(np.testing.assert_array_equal, before,
               snapshot(nnx.to_pure_dict(nnx.state(Net(blocks)))))


# ---------------------------------------------------------------------------- 3. purity
def test_apply_is_pure_under_jit_vjp_grad():
  blocks = make_blocks()
  before = snapshot(nnx.to_pure_dict(nnx.state(Net(blocks))))
  st = Stage.from_nnx(blocks[1:3], first_block=1)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
  params, state = st.init(None, x)
  # No RNG state among params or model state: only float arrays of the Param/BatchStat leaves.
  for tree in (params, state):
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(tree))
  assert set(params) == {"block_1", "block_2"} and set(state) == {"block_1"}
  rng = jax.random.PRNGKey(5)

  f = jax.jit(lambda p, s, x, r: st.apply(p, s, x, train=True, rng=r))
  (y1, s1), (y2, s2) = f(params, state, x, rng), f(params, state, x, rng)
  np.testing.assert_array_equal(y1, y2)
  jax.tree.map(np.testing.assert_array_equal, s1, s2)
  y3, s3 = st.apply(params, state, x, train=True, rng=rng)   # eager == jit
  np.testing.assert_allclose(y1, y3, **TOL)
  close(s1, s3)

  y4, vjp, s4 = fdg_jax.stages.training_vjp(st, params, state, x, rng)
  np.testing.assert_allclose(y4, y1, **TOL)
  close(s4, s1)
  ct = jnp.ones_like(y4)
  gp, gx, _ = vjp(ct)
  gp2, gx2 = jax.grad(lambda p, a: jnp.sum(st.apply(p, state, a, train=True, rng=rng)[0]),
                      argnums=(0, 1))(params, x)
  close(gp, gp2)
  np.testing.assert_allclose(gx, gx2, **TOL)
  assert float(jnp.abs(gx).sum()) > 0

  ye1, se = st.apply(params, state, x, train=False)
  ye2, _ = jax.jit(lambda p, s, x: st.apply(p, s, x, train=False))(params, state, x)
  assert se is state
  np.testing.assert_allclose(ye1, ye2, **TOL)

  # The modules the stage was made from (params, batch stats, rng streams) are unchanged.
  after = snapshot(nnx.to_pure_dict(nnx.state(Net(blocks))))
  jax.tree.map(np.testing.assert_array_equal, before, after)
