"""Splitting: the split network computes the unsplit one; balancing is optimal; errors are clear.

The reference for "the unsplit network" is the plain Flax apply of `model.module()`, not the
Stage machinery under test.
"""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fdg_jax import delays, models, partition, stages as stages_lib
from fdg_jax.summary import main as summary_main

TOL = dict(rtol=1e-5, atol=1e-5)


def fast_jit(fn, *args):
  """Compiles `fn` with XLA's backend optimisations off (half the CPU compile time; reference
  and split are compiled together, so both see the same numerics) and calls it."""
  return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)

TINY = {  # name -> (model, input shape)
    "mlp": (lambda: models.create("mlp", widths=(16, 12, 8)), (2, 4, 4, 3)),
    "cnn": (lambda: models.create("cnn", channels=(4, 6), hidden=8), (2, 8, 8, 3)),
    "resnet20": (lambda: models.create("resnet20"), (2, 8, 8, 3)),
    "wrn10_1": (lambda: models.create("wrn", depth=10, width=1), (2, 8, 8, 3)),
}


def close(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **TOL), a, b)


def random_variables(model, x, seed=0):
  """Random variables shaped like the unsplit model's, without compiling an init.

  Running variances are kept positive and means non-zero, so eval mode really uses them.
  """
  struct = jax.eval_shape(lambda x: model.module().init(jax.random.key(0), x, train=False), x)
  rng = np.random.default_rng(seed)

  def fill(path, a):
    if jax.tree_util.keystr(path[-1:]) == "['var']":
      return jnp.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype)
    return jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype)

  return jax.tree_util.tree_map_with_path(fill, struct)


def reference(model, variables, x, train, rng=None):
  """Unsplit forward: (output, new model state) with plain Flax."""
  state = {k: v for k, v in variables.items() if k != "params"}
  rngs = {} if rng is None else {"dropout": rng}
  if train and state:
    return model.module().apply(variables, x, train=True, mutable=list(state), rngs=rngs)
  return model.module().apply(variables, x, train=train, rngs=rngs), state


def outputs_and_grads(forward, params):
  """{train: (y, new state, d sum(y^2) / d params)} for train in (False, True)."""
  out = {}
  for train in (False, True):
    def loss(p):
      y, s = forward(p, train)
      return jnp.sum(y ** 2), (y, s)
    (_, (y, s)), g = jax.value_and_grad(loss, has_aux=True)(params)
    out[train] = (y, s, g)
  return out


@pytest.mark.parametrize("name", list(TINY))
def test_split_computes_the_unsplit_network(name):
  make, shape = TINY[name]
  model = make()
  n = model.num_blocks
  x = jax.random.normal(jax.random.key(0), shape)
  variables = random_variables(model, x)
  full_params = variables["params"]
  full_state = {k: v for k, v in variables.items() if k != "params"}

  splits = {}
  for how, K in [("uniform", 2), ("balanced", 3), ([1, n - 1], 3)]:
    bounds = partition.boundaries(model, K, how, example_input=x)
    stages = partition.split(model, K, how, example_input=x)
    assert len(stages) == K and partition.check_boundaries(bounds, K, n) == bounds
    splits[str(how)] = (bounds, stages)
    # The stages' own init gives the same variable structure as the unsplit init.
    p0, s0 = jax.eval_shape(lambda: stages_lib.init_stages(stages, jax.random.key(3), x))
    assert jax.tree.structure(partition.merge_trees(p0)) == jax.tree.structure(full_params)
    assert jax.tree.structure(partition.merge_trees(s0)) == jax.tree.structure(full_state)

  # One compilation for the reference and every split (XLA CPU compiles are the slow part).
  def run(full_params, full_state):
    ref = outputs_and_grads(
        lambda p, train: reference(model, {"params": p, **full_state}, x, train), full_params)
    got = {}
    for key, (bounds, stages) in splits.items():
      states = partition.split_tree(full_state, bounds)
      got[key] = outputs_and_grads(
          lambda ps, train: stages_lib.forward(stages, ps, states, x, train=train),
          partition.split_tree(full_params, bounds))
    return ref, got

  ref, got = fast_jit(run, full_params, full_state)
  for key in splits:
    for train in (False, True):
      y, new_states, grads = got[key][train]
      y_ref, state_ref, grads_ref = ref[train]
      assert float(jnp.abs(y_ref).max()) > 1e-3  # not a degenerate comparison
      close(y, y_ref)
      close(partition.merge_trees(new_states), state_ref)
      close(partition.merge_trees(grads), grads_ref)


def test_dropout_masks_do_not_depend_on_the_split():
  # Blocks keep their global names, so a block's dropout stream is the same in any split.
  model = models.create("wrn", depth=10, width=1, dropout=0.5)
  x = jax.random.normal(jax.random.key(0), (2, 8, 8, 3))
  variables = random_variables(model, x)
  bounds = [2, 3]
  stages = partition.split(model, 3, bounds)

  def both(variables, rng):
    params = partition.split_tree(variables["params"], bounds)
    states = partition.split_tree({"batch_stats": variables["batch_stats"]}, bounds)
    h = x
    for st, p, s in zip(stages, params, states):
      h, _ = st.apply(p, s, h, train=True, rng=rng)
    return h, reference(model, variables, x, True, rng)[0]

  close(*fast_jit(both, variables, jax.random.key(7)))


def test_uniform_and_paper_boundaries():
  m56 = models.create("resnet56")
  assert partition.boundaries(m56, 4, "uniform") == [7, 14, 21]
  assert partition.boundaries(m56, 4, "paper") == [7, 14, 21]
  assert partition.boundaries(m56, 2, "paper") == [14]
  assert partition.boundaries(m56, 1, "paper") == []
  assert partition.boundaries(models.create("resnet20"), 3, "uniform") == [3, 7]  # 3, 4, 4
  stages = partition.split(m56, 4, "paper")
  assert [s.name for s in stages] == ["resnet56[0:7]", "resnet56[7:14]", "resnet56[14:21]",
                                      "resnet56[21:29]"]


def stage_cost(costs, memory, w, bounds):
  """The balanced objective, written out: max over stages of the blended, normalised cost."""
  n, K = len(costs), len(bounds) + 1
  if K == 1:  # one stage: all the compute, and no stash
    return 1.0 - w
  return max((1 - w) * costs[i:j].sum() / costs.sum()
             + w * 2 * (K - 1 - k) * memory[i:j].sum() / (2 * (K - 1) * memory.sum())
             for k, (i, j) in enumerate(partition.stage_ranges(list(bounds), n)))


@pytest.mark.parametrize("seed", range(4))
def test_balance_is_optimal(seed):
  rng = np.random.default_rng(seed)
  n, K = 9, 1 + seed % 4
  costs, memory = rng.uniform(0.1, 1, n), rng.uniform(0.1, 1, n)
  for w in (0.0, 0.3, 1.0):
    b = partition.balance(costs, K, memory=memory, memory_weight=w, schedule="fdg")
    assert len(b) == K - 1 and b == sorted(set(b)) and all(0 < i < n for i in b)
    brute = min(stage_cost(costs, memory, w, c) for c in itertools.combinations(range(1, n), K - 1))
    assert stage_cost(costs, memory, w, b) == pytest.approx(brute)


def test_memory_weight_trades_compute_for_stash():
  # Equal compute and memory per block: compute balance gives equal stages; w = 1 moves blocks
  # to the later stages, whose stashes are shorter.
  costs = np.ones(12)
  assert partition.balance(costs, 3) == [4, 8]
  b = partition.balance(costs, 3, memory=costs, memory_weight=1.0, schedule="fdg")
  sizes = np.diff([0, *b, 12])
  assert sizes[0] == 1 and sizes[2] >= 9  # stash of stage 0 (4 slots/block) is the bottleneck
  # The stash weighed is the schedule's: DDG's rings hold 3, 2, 0 slots, FDG's 4, 2, 0.
  def brute(rings, w=0.5):
    def cost(b):
      return max((1 - w) * (j - i) / 12 + w * rings[k] * (j - i) / (rings[0] * 12)
                 for k, (i, j) in enumerate(partition.stage_ranges(list(b), 12)))
    return min(cost(b) for b in itertools.combinations(range(1, 12), 2))
  for schedule, rings in (("fdg", (4, 2, 0)), ("ddg", (3, 2, 0))):
    b = partition.balance(costs, 3, memory=costs, memory_weight=0.5, schedule=schedule)
    assert max(0.5 * (j - i) / 12 + 0.5 * rings[k] * (j - i) / (rings[0] * 12) for k, (i, j)
               in enumerate(partition.stage_ranges(b, 12))) == pytest.approx(brute(rings))
  assert (partition.balance(costs, 3, memory=costs, memory_weight=0.5, schedule="fdg")
          != partition.balance(costs, 3, memory=costs, memory_weight=0.5, schedule="ddg"))
  with pytest.raises(ValueError, match="pass schedule="):  # no schedule is assumed
    partition.balance(costs, 3, memory=costs, memory_weight=0.5)


@pytest.mark.parametrize("name", ["resnet56", "resnet110"])
def test_balanced_beats_paper_split_at_k4(name):
  m = models.create(name)
  x = m.example_input(1)  # CIFAR 32x32x3, batch 1; compiled for cost analysis, never run
  flops = partition.block_costs(m, x, "flops")
  stage_flops = lambda b: np.array([flops[i:j].sum()
                                    for i, j in partition.stage_ranges(b, m.num_blocks)])
  paper = stage_flops(partition.boundaries(m, 4, "paper"))
  balanced = stage_flops(partition.boundaries(m, 4, "balanced", example_input=x))
  assert balanced.max() <= paper.max() * (1 + 1e-9)
  assert balanced.max() / balanced.mean() <= 1.10
  # Block granularity: no partition beats the heaviest block.
  assert balanced.max() >= flops.max()


def test_cost_kinds():
  m = models.create("mlp", widths=(64, 8), input_shape=(16,))
  x = jnp.zeros((4, 16))
  fwd = partition.block_costs(m, x, "flops", backward=False)
  # Per example: 2 * fan_in * fan_out for the matmul, fan_out for the bias, fan_out for ReLU.
  np.testing.assert_allclose(fwd, [4 * (2 * 16 * 64 + 2 * 64), 4 * (2 * 64 * 8 + 2 * 8),
                                   4 * (2 * 8 * 10 + 10)], rtol=0.01)
  tick = partition.block_costs(m, x, "flops")
  assert np.all(tick > 2 * fwd)  # the backward adds the weight- and input-gradient products
  np.testing.assert_allclose(partition.block_costs(m, x, "flops", compiled=True), tick, rtol=0.05)
  assert np.all(partition.block_costs(m, x, "bytes") > 0)
  assert np.all(partition.block_costs(m, x, "time") > 0)
  assert partition.boundaries(m, 2, "balanced", example_input=x, cost="time") in ([1], [2])


def test_stash_bytes():
  m = models.create("cnn", channels=(4, 6), hidden=8)
  x = jnp.zeros((2, 8, 8, 3))
  bounds = [1, 2, 3]
  slots = partition.slot_bytes(m, bounds, x)
  for heads in (False, True):
    fdg = partition.stash_bytes(m, bounds, x, "fdg", heads)
    ddg = partition.stash_bytes(m, bounds, x, "ddg", heads)
    # The ring, and its head (every ring here has two slots or more).
    assert fdg == [slots[k] * (2 * (3 - k) + heads) for k in range(3)] + [0]
    assert ddg == [slots[k] * (4 - k + heads) for k in range(3)] + [0]
    assert all(v > 0 for v in fdg[:-1])
    for k in range(3):
      for alg in ("fdg", "ddg"):
        assert partition.ring_length(k, 4, alg, heads) == delays.ring_size(alg, k, 4) + heads
    assert partition.ring_length(3, 4, "fdg", heads) == 0
    assert delays.slots_held("bp", 0, 2, heads) == delays.ring_size("bp", 0, 2) == 1
  default = delays.ring_heads_default(jax.default_backend())
  assert partition.stash_bytes(m, bounds, x, "fdg") == partition.stash_bytes(m, bounds, x,
                                                                             "fdg", default)
  # A slot holds at least the stage input (a conv's backward needs it) and the weights.
  assert slots[0] >= x.size * 4 + (3 * 3 * 3 * 4 + 4) * 4
  # Independent count: the residual leaves of concrete vjps of the first stage at two
  # inputs, but those equal at both and constant (ReLU's vjp keeps an array of zeros, which
  # a slot does not store: `stages.Residuals`).
  st = partition.split(m, 4, bounds)[0]
  p, s = st.init(jax.random.key(0), x)
  residuals = [jax.tree.leaves(jax.jit(lambda p, x: jax.vjp(
      lambda p, x: st.apply(p, s, x, train=True)[0], p, x)[1])(p, x + shift))
               for shift in (jax.random.normal(jax.random.key(i), x.shape) for i in (1, 2))]
  residuals = [[np.asarray(a) for a in leaves] for leaves in residuals]
  constant = [np.array_equal(a, b) and np.all(a == a.flat[0]) for a, b in zip(*residuals)]
  assert sum(constant) == 1  # the ReLU of its one block
  assert slots[0] == sum(a.nbytes for a, c in zip(residuals[0], constant) if not c)
  assert slots[0] < sum(a.nbytes for a in residuals[0])


def test_split_tree_round_trip():
  m = models.create("resnet20")
  v = jax.eval_shape(lambda x: m.module().init(jax.random.key(0), x, train=False),
                     m.example_input(1))
  state = {"batch_stats": v["batch_stats"]}
  parts = partition.split_tree(state, [5, 10])
  assert sorted(parts[0]["batch_stats"]) == [f"block_{i}" for i in range(5)]
  assert sorted(parts[1]["batch_stats"]) == [f"block_{i}" for i in range(5, 10)]
  # The head has no BatchNorm: its stage's state has no batch_stats collection, like its init.
  assert parts[2] == {}
  assert partition.merge_trees(parts) == state
  with pytest.raises(ValueError, match="not under a block_i key"):
    partition.split_tree({"w": 1}, [1])


@pytest.mark.parametrize("how,K,match", [
    ("uniform", 12, "cannot split 11 blocks into 12 stages"),
    ("uniform", 0, "positive integer"),
    ([0, 5], 3, "out of range"),
    ([3, 11], 3, "out of range"),
    ([5, 5], 3, "strictly increasing"),
    ([6, 2], 3, "strictly increasing"),
    ([3], 3, "3 stages need 2 boundaries"),
    ([1.5], 2, "integers"),
    ("paper", 4, "no paper split of resnet20"),
    ("random", 2, "unknown split 'random'"),
])
def test_split_errors(how, K, match):
  with pytest.raises(ValueError, match=match) as e:
    partition.split(models.create("resnet20"), K, how)
  assert "\n" not in str(e.value)


def test_other_errors():
  with pytest.raises(ValueError, match="available: K = 2, 4"):
    partition.boundaries(models.create("resnet56"), 3, "paper")
  with pytest.raises(ValueError, match="unknown cost"):
    partition.boundaries(models.create("mlp"), 2, "balanced", cost="energy")
  with pytest.raises(ValueError, match="memory_weight"):
    partition.balance([1, 2, 3], 2, memory=[1, 1, 1], memory_weight=2.0)


def test_summary_cli(capsys):
  assert summary_main(["--model", "mlp", "--num-stages", "2", "--split", "uniform",
                       "--batch-size", "4", "--json"]) == 0
  s = json.loads(capsys.readouterr().out)
  assert s["boundaries"] == [1] and s["batch_size"] == 4 and len(s["stages"]) == 2
  st0, st1 = s["stages"]
  assert st0["params"] == 32 * 32 * 3 * 256 + 256 and st1["params"] == 256 * 256 + 256 + 2570
  assert st0["flops_per_sample"] == pytest.approx(2 * 32 * 32 * 3 * 256, rel=0.01)
  assert st0["activation_bytes_per_sample"] == 256 * 4
  # K=2: FDG's ring has 2(K-1) = 2 slots and DDG's K = 2 slots.
  assert st0["fdg_stash_bytes"] == st0["ddg_stash_bytes"] > 0 and st1["fdg_stash_bytes"] == 0
  assert s["imbalance"] >= 1.0
  assert summary_main(["--model", "cnn", "--num-stages", "3"]) == 0
  out = capsys.readouterr().out
  assert "imbalance" in out and "FDG stash (batch 1)" in out


@pytest.mark.parametrize("argv,match", [
    (["--model", "nope", "--num-stages", "2"], "unknown model"),
    (["--model", "mlp"], "required"),
    (["--model", "mlp", "--num-stages", "9"], "cannot split"),
    (["--model", "mlp", "--num-stages", "2", "--split", "x,y"], "--split"),
    (["--model", "mlp", "--num-stages", "2", "--split", "paper"], "no paper split"),
    (["--model", "mlp", "--num-stages", "2", "--batch-size", "0"], "batch size"),
])
def test_summary_bad_arguments(capsys, argv, match):
  assert summary_main(argv) == 2
  err = capsys.readouterr().err
  assert match in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("name", ["mlp", "resnet20"])
def test_residuals_store_all_but_constants(name):
  """`stages.Residuals`: a slot keeps every vjp residual but constants (those equal at two
  inputs and uniform; every one of the batch's size, e.g. ReLU's zeros, is left out), and
  the vjp rebuilt from it gives the gradients bit for bit."""
  from fdg_jax.stages import Residuals, training_vjp
  m = models.create(name, **({"widths": (16, 16), "input_shape": (4, 4, 1)}
                             if name == "mlp" else {}))
  spec = m.example_input(2)
  x = jnp.zeros(spec.shape, spec.dtype)
  st = partition.split(m, 2, partition.boundaries(m, 2, "uniform", example_input=x))[0]
  p, s = st.init(jax.random.key(0), x)
  key = jax.random.PRNGKey(0)
  stored, res, _ = Residuals.trace(st, p, s, x, key)
  leaves_at = jax.jit(lambda p, x: jax.tree.leaves(training_vjp(st, p, s, x, key)[1]))
  inputs = [(jax.tree.map(lambda a, i=i: a + 0.1 * jax.random.normal(jax.random.key(i),
                                                                      a.shape), p),
             jax.random.normal(jax.random.key(i), x.shape)) for i in (1, 2)]
  a, b = ([np.asarray(v) for v in leaves_at(*args)] for args in inputs)
  constant = [i for i, (u, v) in enumerate(zip(a, b))
              if np.array_equal(u, v) and np.all(u == u.flat[0])]
  fills = [i for i, *_ in res.fills]
  assert fills and set(fills) <= set(constant)  # one per ReLU at least
  # What stays stored of the constants is small: none has the batch's size (BatchNorm's
  # vjp keeps a few per-channel ones, computed rather than broadcast).
  assert all(a[i].shape[:1] != (2,) for i in set(constant) - set(fills))
  assert [(t.shape, t.dtype) for t in stored] == [
      (u.shape, u.dtype) for i, u in enumerate(a) if i not in fills]
  # The constants rebuilt are the vjp's own, leaf for leaf.
  full = jax.jit(lambda l: jax.tree.leaves(res.vjp_fn(l)))(res.stored(leaves_at(*inputs[0])))
  for u, v in zip(a, full):
    np.testing.assert_array_equal(u, v)
  y = jax.eval_shape(lambda x: training_vjp(st, p, s, x, key)[0], x)
  ct = jax.random.normal(jax.random.key(3), y.shape, y.dtype)
  whole = jax.jit(lambda l: jax.tree.unflatten(res.treedef, l)(ct))(leaves_at(*inputs[0]))
  rebuilt = jax.jit(lambda l: res.vjp_fn(l)(ct))(res.stored(leaves_at(*inputs[0])))
  for u, v in zip(jax.tree.leaves(whole), jax.tree.leaves(rebuilt)):
    np.testing.assert_array_equal(u, v)
