"""DP x FDG across two real JAX processes on localhost == the same mesh in one process.

The test launches this file twice as a worker (`python -m fdg_jax.launch`'s `launch`, which
stops both on failure or timeout). Each worker joins the run through
`fdg_jax.runtime.initialize()` (jax.distributed + gloo CPU collectives), holds 2 CPU devices
of the global (data=2, stage=2) mesh (one replica's two stages), feeds only its half of every
global batch, and writes the trained parameters to an .npz. Stage-to-stage moves are then
the shard-by-shard local moves of `Placement`, and the gradient/BatchNorm reductions over
the data axis cross the process boundary.
"""

import os
import sys

import numpy as np
import pytest

ALGORITHMS = ("bp", "ddg", "fdg")
NUM_TICKS = 6
BATCH = 8


def train(algorithm, mesh):
  """Trains the 2-stage BN toy model on `mesh`, each process feeding its rows of the batch."""
  import optax

  import fdg_jax
  from toy_models import batches, loss_fn, make_model

  applies, params, states = make_model("bn", 2)
  sched = fdg_jax.create(algorithm, [fdg_jax.Stage(apply=a) for a in applies], loss_fn,
                         optax.sgd(0.05, 0.9), mesh=mesh)
  state = sched.init(params, states)
  rows = sched.placement.local_batch_slice(BATCH)
  for x, y in batches(NUM_TICKS, batch_size=BATCH):
    state, _ = sched.step(state, (np.asarray(x)[rows], np.asarray(y)[rows]))
  return flat(sched.params(state), sched.model_states(state), prefix=algorithm)


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
  # Each replica (mesh row) lies in one process: the case the local move serves.
  assert all(len({d.process_index for d in row}) == 1 for row in mesh.devices)
  # A pipeline across processes (stage 0 in one, stage 1 in the other) is refused up front.
  try:
    fdg_jax.Placement.create(2, mesh=Mesh(mesh.devices.T, mesh.axis_names))
  except ValueError as e:
    assert "one process" in str(e)
  else:
    raise AssertionError("a mesh whose rows span processes was accepted")
  results = {}
  for algorithm in ALGORITHMS:
    results.update(train(algorithm, mesh))
  np.savez(os.path.join(out_dir, f"params_{jax.process_index()}.npz"), **results)


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
    expected.update(train(algorithm, runtime.make_mesh(2, 2)))
  for process in (0, 1):
    got = np.load(tmp_path / f"params_{process}.npz")
    assert sorted(got.files) == sorted(expected)
    for name, value in expected.items():
      np.testing.assert_allclose(got[name], value, atol=1e-5, rtol=0, err_msg=name)


if __name__ == "__main__":
  worker(sys.argv[1])
