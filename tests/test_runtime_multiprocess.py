"""Schedules across two real JAX processes on localhost == the same mesh in one process.

The test launches this file twice as a worker (`python -m fdg_jax.launch`'s `launch`, which
stops both on failure or timeout). Each worker joins the run through
`fdg_jax.runtime.initialize()` (jax.distributed + gloo CPU collectives), holds 2 CPU devices
of a global (data=2, stage=2) mesh, and writes the trained parameters to an .npz. Two
layouts of that mesh:

- "replicas": each process holds one replica's two stages and feeds its half of every
  global batch. Stage-to-stage moves are the shard-by-shard local moves of `Placement`; the
  gradient/BatchNorm reductions over the data axis cross the process boundary.
- "pipeline": each process holds one stage of both replicas (the mesh transposed), so
  every activation and cotangent crosses the process boundary (`placement.exchange`);
  process 0 feeds whole batches, process 1 feeds none.

A third case passes `devices=` with one device of each process (FDG, R=1). A second test
runs three stages in three processes (one device each), where each exchange involves two
of the three processes.

Each layout trains through `step` and through `run`; the values are fetched to every
process with `runtime.arrays.fetch`, and a checkpoint view of the final state goes
through orbax and back unchanged.
"""

import os
import sys

import numpy as np
import pytest

ALGORITHMS = ("bp", "ddg", "fdg")
NUM_TICKS = 6
BATCH = 8


def train(algorithm, mesh, path="step", engine="auto"):
  """Trains the K-stage BN toy model on `mesh` (or a list of K devices), each process
  feeding its rows of the batch."""
  import optax

  import fdg_jax
  from fdg_jax.runtime import arrays
  from toy_models import batches, loss_fn, make_model

  applies, params, states = make_model("bn", len(mesh) if isinstance(mesh, list)
                                        else mesh.devices.shape[1])
  where = {"devices": mesh} if isinstance(mesh, list) else {"mesh": mesh}
  sched = fdg_jax.create(algorithm, [fdg_jax.Stage(apply=a) for a in applies], loss_fn,
                         optax.sgd(0.05, 0.9), engine=engine, **where)
  state = sched.init(params, states)
  feeds = sched.placement.feeder() is not None
  rows = sched.placement.local_batch_slice(BATCH) if feeds else slice(None)
  data = [(np.asarray(x)[rows], np.asarray(y)[rows])
          for x, y in batches(NUM_TICKS, batch_size=BATCH)]
  if path == "run":
    state, _ = sched.run(state, tuple(np.stack(column) for column in zip(*data)))
  else:
    for b in data:
      state, _ = sched.step(state, b)
  values = arrays.fetch((sched.params(state), sched.model_states(state)))
  prefix = f"{algorithm}/{path}" + ("/spmd" if engine == "spmd" else "")
  return flat(*values, prefix=prefix), state


def checkpoint_round_trip(state, directory):
  """The state saved through its checkpoint views and restored: equal, where it was."""
  import jax
  import orbax.checkpoint as ocp

  from fdg_jax.runtime import arrays
  arrays.single_replica_writes()
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(directory, arrays.to_checkpoint(state), force=True)
  checkpointer.wait_until_finished()
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, state)
  restored = arrays.from_checkpoint(
      checkpointer.restore(directory, arrays.checkpoint_target(target)), target)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    if isinstance(a, jax.Array):
      assert a.sharding == b.sharding
      for x, y in zip(a.addressable_shards, b.addressable_shards):
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))


def flat(params, states, prefix):
  import jax
  out = {}
  for name, tree in (("params", params), ("states", states)):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      # Replicated over the processes, so each process can read the whole value.
      out[f"{prefix}/{name}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
  return out


def worker(out_dir):
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax
  from jax.sharding import Mesh

  import fdg_jax
  from fdg_jax import runtime
  assert runtime.initialize()
  assert jax.process_count() == 2 and len(jax.local_devices()) == 2, jax.devices()
  mesh = runtime.make_mesh(2, 2)
  # "replicas": each replica (mesh row) lies in one process; "pipeline": each row spans both.
  assert all(len({d.process_index for d in row}) == 1 for row in mesh.devices)
  layouts = {"replicas": mesh, "pipeline": Mesh(mesh.devices.T, mesh.axis_names)}
  assert fdg_jax.Placement.create(2, mesh=layouts["pipeline"]).spans_processes
  for layout, m in layouts.items():
    results = {}
    for algorithm in ALGORITHMS:
      for path in ("step", "run"):
        values, state = train(algorithm, m, path)
        results.update(values)
    checkpoint_round_trip(state, os.path.join(out_dir, f"ckpt_{layout}"))
    for path in ("step", "run"):  # the SPMD engine: one program over the processes' devices
      values, state = train("fdg", m, path, engine="spmd")
      results.update(values)
    checkpoint_round_trip(state, os.path.join(out_dir, f"ckpt_{layout}_spmd"))
    np.savez(os.path.join(out_dir, f"{layout}_{jax.process_index()}.npz"), **results)
  # A device list whose devices lie in different processes: one stage per process.
  devices = [mesh.devices[0, 0], mesh.devices[1, 0]]
  assert devices[0].process_index != devices[1].process_index
  values, _ = train("fdg", devices, "run")
  values.update(train("fdg", devices, "run", engine="spmd")[0])
  np.savez(os.path.join(out_dir, f"devices_{jax.process_index()}.npz"), **values)


def test_two_processes_equal_one_process(tmp_path):
  import jax

  from fdg_jax import launch, runtime
  assert len(jax.devices()) >= 4
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                    env.get("PYTHONPATH")]))
  status = launch.launch([sys.executable, os.path.abspath(__file__), str(tmp_path)], 2,
                         cpu_devices=2, timeout_s=240, env=env)
  assert status == 0, f"workers exited with {status} (their output is in the captured stdout)"
  expected = {}
  for algorithm in ALGORITHMS:
    for path in ("step", "run"):
      expected.update(train(algorithm, runtime.make_mesh(2, 2), path)[0])
  for path in ("step", "run"):
    expected.update(train("fdg", runtime.make_mesh(2, 2), path, engine="spmd")[0])
  for layout in ("replicas", "pipeline"):
    for process in (0, 1):
      got = np.load(tmp_path / f"{layout}_{process}.npz")
      assert sorted(got.files) == sorted(expected)
      for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=0,
                                   err_msg=f"{layout}, process {process}: {name}")
  one_batch = train("fdg", jax.devices()[:1] * 2, "run")[0]  # R=1: one replica's batch
  for name, value in train("fdg", jax.devices()[:1] * 2, "run")[0].items():
    one_batch[name.replace("fdg/run/", "fdg/run/spmd/", 1)] = value  # SPMD against fused
  for process in (0, 1):
    got = np.load(tmp_path / f"devices_{process}.npz")
    assert sorted(got.files) == sorted(one_batch)
    for name, value in one_batch.items():
      np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=0, err_msg=name)


def three_stage_worker(out_dir):
  """One stage per process (3 processes x 1 device): the exchange between stages 0 and 1
  runs in processes 0 and 1 only, process 2 taking the arrays without shards."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax

  from fdg_jax import runtime
  assert runtime.initialize() and jax.process_count() == 3
  devices = sorted(jax.devices(), key=lambda d: d.process_index)
  results = {}
  for algorithm in ALGORITHMS:
    for path in ("step", "run"):
      results.update(train(algorithm, devices, path)[0])
  np.savez(os.path.join(out_dir, f"three_{jax.process_index()}.npz"), **results)


def test_three_stages_in_three_processes_equal_one_device(tmp_path):
  import jax

  from fdg_jax import launch
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                    env.get("PYTHONPATH")]))
  status = launch.launch([sys.executable, os.path.abspath(__file__), str(tmp_path), "three"],
                         3, cpu_devices=1, timeout_s=240, env=env)
  assert status == 0, f"workers exited with {status} (their output is in the captured stdout)"
  expected = {}
  for algorithm in ALGORITHMS:
    for path in ("step", "run"):
      expected.update(train(algorithm, jax.devices()[:1] * 3, path)[0])
  for process in range(3):
    got = np.load(tmp_path / f"three_{process}.npz")
    assert sorted(got.files) == sorted(expected)
    for name, value in expected.items():
      np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=0,
                                 err_msg=f"process {process}: {name}")


if __name__ == "__main__":
  if sys.argv[2:] == ["three"]:
    three_stage_worker(sys.argv[1])
  else:
    worker(sys.argv[1])
