"""Runtime: per-stage devices without implicit transfers or host syncs, DP x FDG on a mesh.

Data parallelism is checked against its definition (docs/algorithms.md, "DP x FDG"): R replicas
fed the shards of a global batch end with the parameters of one replica fed all of it.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fdg_jax
from fdg_jax import launch, runtime
from fdg_jax.placement import move_shards
from toy_models import assert_trees_close, batches, loss_fn, make_model


def stages_of(applies):
  return [fdg_jax.Stage(apply=a) for a in applies]


def run(schedule, params, states, data):
  state = schedule.init(params, states)
  for b in data:
    state, _ = schedule.step(state, b)
  return state


def cache_sizes(schedule):
  return {key: fn._cache_size() for key, fn in schedule.engine_impl.fns.items()}


# ---------------------------------------------------------------------------- placement
def test_make_mesh_and_placement_shardings():
  mesh = runtime.make_mesh(2, 2)
  assert mesh.axis_names == ("data", "stage") and mesh.devices.shape == (2, 2)
  placement = fdg_jax.Placement.create(2, mesh=mesh)
  for k in range(2):
    column = set(mesh.devices[:, k])
    assert placement.state_shardings[k].device_set == column
    assert placement.batch_shardings[k].spec == P("data")
  assert placement.local_batch_slice(8) == slice(0, 8)
  assert placement.buffer_sharding(0, 2).spec == P(None, None, "data")
  assert placement.buffer_sharding(0, None) == placement.state_shardings[0]
  with pytest.raises(ValueError, match="need 8 devices"):
    runtime.make_mesh(4, 2)


def test_move_shards_copies_each_local_shard_to_the_next_column():
  """The multi-process move, run in one process: same values, target sharding, per shard."""
  grid = np.asarray(jax.devices()[:4]).reshape(2, 2)
  col = [Mesh(grid[:, k], ("data",)) for k in range(2)]
  x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(col[0], P("data")))
  target = NamedSharding(col[1], P("data"))
  with jax.transfer_guard("disallow"):
    y = move_shards(x, target)
  assert y.sharding == target
  np.testing.assert_array_equal(np.asarray(y), np.arange(16.0).reshape(8, 2))
  for shard in y.addressable_shards:
    row = list(grid[:, 1]).index(shard.device)
    np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x)[4 * row:4 * row + 4])
  scalar = jax.device_put(jnp.int32(7), NamedSharding(col[0], P()))
  assert int(move_shards(scalar, NamedSharding(col[1], P()))) == 7
  # Replicating a sharded array needs rows this "process" would not hold shard by shard.
  with pytest.raises(ValueError, match="within a process"):
    move_shards(x, NamedSharding(col[1], P()))


def test_put_batches_decides_each_layout_of_messages_once():
  """The per-stage engine's message moves: right devices and values, a layout's decisions
  reused, and a new layout (host data, arrays already in place) decided afresh."""
  devs = jax.devices()[:2]
  placement = fdg_jax.Placement.create(2, devices=devs)
  on = lambda d: jax.sharding.SingleDeviceSharding(d)
  produce = jax.jit(lambda x: (2 * x, jnp.sum(x).astype(jnp.int32)),
                    out_shardings=(on(devs[0]), on(devs[0])))
  x = jax.device_put(jnp.arange(6.0).reshape(3, 2), devs[0])
  for i in range(3):  # fresh outputs of one program each time: one plan
    h, n = produce(x + i)
    (h1, n1), = placement.put_batches([(1, (h, n))])
    assert h1.devices() == {devs[1]} and n1.devices() == {devs[1]}
    np.testing.assert_array_equal(np.asarray(h1), 2 * (np.arange(6.0).reshape(3, 2) + i))
    assert int(n1) == int(np.sum(np.arange(6.0) + i))
  assert len(placement._plans) == 1
  # Host data goes by device_put; arrays already on stage 1 stay as they are.
  (g, m), = placement.put_batches([(1, (np.ones((3, 2), np.float32), h1))])
  assert g.devices() == {devs[1]} and m is h1
  assert len(placement._plans) == 2
  # The first tree structure with its leaves already on device 1: kept, not moved again.
  (h2, n2), = placement.put_batches([(1, (h1, n1))])
  assert h2 is h1 and n2 is n1 and len(placement._plans) == 3
  # The first layout again (its leaves on device 0): moved by the first plan.
  (h3, _), = placement.put_batches([(1, produce(x))])
  assert h3.devices() == {devs[1]} and len(placement._plans) == 3


# ---------------------------------------------------------------------------- async ticks
PLACEMENTS = {
    "devices": lambda K: {"devices": jax.devices()[:K]},
    "mesh": lambda K: {"mesh": runtime.make_mesh(len(jax.devices()) // K, K)},
}


@pytest.mark.parametrize("placement,K", [("devices", 4), ("mesh", 2)])
@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
def test_steady_state_tick_makes_no_implicit_transfer(algorithm, placement, K):
  """After warm-up, with the batch on stage 0, a tick moves data only by explicit device_put.

  transfer_guard("disallow") refuses every implicit host<->device and device<->device
  transfer (an explicit device_put is allowed), so no host round trip (a read of a device
  value, which would also block the tick) and no silent copy happens inside `step`.
  """
  applies, params, states = make_model("bn", K)
  sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn, optax.sgd(0.05, 0.9),
                         **PLACEMENTS[placement](K))
  data = batches(2 * K + 3)
  state = run(sched, params, states, data[:2 * K])
  sizes = cache_sizes(sched)
  on_stage0 = [sched.placement.put_batch(0, b) for b in data[2 * K:]]
  with jax.transfer_guard("disallow"):
    for b in on_stage0:
      state, metrics = sched.step(state, b)
  assert cache_sizes(sched) == sizes and set(sizes.values()) == {1}
  assert all(u is not None for u in metrics["updated"])
  jax.block_until_ready(state)


def test_step_returns_before_the_device_work_is_done():
  """A tick only enqueues work: step() returns long before a heavy stage finishes."""
  def heavy(params, model_state, x, *, train=True, rng=None):
    # ~0.1-0.5 s of matmuls on a CPU device, whose result feeds the output (not dead code).
    m = jnp.full((256, 256), 1.0 / 256, jnp.float32)
    start = jnp.ones((256, 256)) * params["w"][0, 0]  # data-dependent: nothing to fold
    h = jax.lax.fori_loop(0, 100, lambda i, a: jnp.tanh(a @ m + 0.01), start)
    return jnp.tanh(x @ params["w"]) + 1e-6 * h[:x.shape[0], :x.shape[1]], model_state

  applies, params, states = make_model("mlp", 2)
  sched = fdg_jax.fdg([fdg_jax.Stage(apply=heavy), fdg_jax.Stage(apply=applies[1])], loss_fn,
                      optax.sgd(0.05), devices=jax.devices()[:2])
  data = [sched.placement.put_batch(0, b) for b in batches(6)]
  state = run(sched, params, states, data[:3])
  jax.block_until_ready(state)
  ratios = []
  for b in data[3:]:
    start = time.perf_counter()
    with jax.transfer_guard_device_to_host("disallow"):
      state, _ = sched.step(state, b)
    dispatched = time.perf_counter() - start
    jax.block_until_ready(state)
    ratios.append(dispatched / (time.perf_counter() - start))
  # Dispatch is milliseconds against a tick of 100s of ms; allow slack for a loaded machine.
  assert min(ratios) < 0.25, ratios


# ---------------------------------------------------------------------------- DP x FDG
@pytest.mark.parametrize("model", ["mlp", "bn"])
@pytest.mark.parametrize("algorithm", ["bp", "ddg", "fdg"])
def test_replicas_equal_one_replica_fed_the_global_batch(algorithm, model):
  """Mesh (data=2, stage=2) == mesh (1, 2) on the same global batches (1e-5).

  The loss is a mean over the global batch inside one global jit, so its gradient is the
  replica average, and BatchNorm's batch mean is the global one (synchronised statistics).
  """
  K = 2
  applies, params, states = make_model(model, K)
  data = batches(2 * K + 3)
  results = []
  for replicas in (1, 2):
    sched = fdg_jax.create(algorithm, stages_of(applies), loss_fn, optax.sgd(0.05, 0.9),
                           mesh=runtime.make_mesh(replicas, K))
    state = run(sched, params, states, data)
    assert set(cache_sizes(sched).values()) == {1}, cache_sizes(sched)
    results.append((sched.params(state), sched.model_states(state)))
    if replicas == 2:
      # Every replica of a stage holds the same parameters; activations in the stash are
      # split over the replicas rather than copied to each.
      for s in state["stages"]:
        for leaf in jax.tree.leaves(s["core"]):
          a, b = (np.asarray(x.data) for x in leaf.addressable_shards)
          np.testing.assert_array_equal(a, b)
      specs = [a.sharding.spec for a in jax.tree.leaves(state["stages"][0]["stash"])]
      assert P(None, "data") in specs
  assert_trees_close(results[1], results[0], atol=1e-5)
  for k in range(K):
    assert not np.allclose(np.asarray(results[1][0][k]["w"]), np.asarray(params[k]["w"]))


def test_one_replica_mesh_equals_one_device_per_stage():
  K = 2
  applies, params, states = make_model("bn", K)
  data = batches(5)
  out = []
  for kwargs in ({"devices": jax.devices()[:K]}, {"mesh": runtime.make_mesh(1, K)}):
    sched = fdg_jax.fdg(stages_of(applies), loss_fn, optax.adam(1e-2), **kwargs)
    out.append(sched.params(run(sched, params, states, data)))
  assert_trees_close(out[0], out[1], atol=1e-6)


# ---------------------------------------------------------------------------- set-up
def test_initialize_without_a_multi_process_environment_does_nothing(monkeypatch):
  for name in (runtime.ENV_COORDINATOR, runtime.ENV_NUM_PROCESSES, runtime.ENV_PROCESS_ID,
               "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    monkeypatch.delenv(name, raising=False)
  assert runtime.initialize() is False
  assert runtime.initialize(num_processes=1) is False
  monkeypatch.setenv(runtime.ENV_NUM_PROCESSES, "2")
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    runtime.initialize()


def test_launcher_sets_each_process_environment_and_stops_the_rest_on_failure():
  check = ("import os; assert os.environ['JAX_NUM_PROCESSES'] == '2'; "
           "assert os.environ['JAX_NUM_CPU_DEVICES'] == '3'; "
           "assert os.environ['JAX_COORDINATOR_ADDRESS'].startswith('127.0.0.1:'); "
           "print('id', os.environ['JAX_PROCESS_ID'])")
  assert launch.main(["--num-processes", "2", "--cpu-devices", "3", "--",
                      sys.executable, "-c", check]) == 0
  fail = ("import os, sys, time; pid = os.environ['JAX_PROCESS_ID']; "
          "sys.exit(3) if pid == '1' else time.sleep(60)")
  start = time.monotonic()
  assert launch.launch([sys.executable, "-c", fail], 2, timeout_s=50) == 3
  assert time.monotonic() - start < 30
  assert launch.launch([sys.executable, "-c", "import time; time.sleep(60)"], 1,
                       timeout_s=1) == 124
  assert launch.main(["--num-processes", "2"]) == 2
