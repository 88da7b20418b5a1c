"""`basis_rotation` never wedges XLA:CPU (jaxlib's batched LAPACK kernels).

jaxlib 0.10's CPU LAPACK kernels (QR, eigh, ...) split a batch of matrices into chunks on
XLA:CPU's intra-op thread pool and block their pool thread until the chunks are done. When
as many such calls run at once as the pool has threads (one per core), no thread is left to
run a chunk and the process waits for ever. `basis_rotation` refreshes its bases with a
batched QR per group of equally shaped weight matrices, so on a small machine a pipeline of
stages wedged within a few refreshes. Each case below runs in a child process under a
timeout, so that a hang fails the test instead of stopping the suite.
"""

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
    import numpy as np, optax, fdg_jax
    from fdg_jax import models, optimizers, partition
    engine, call, ticks = sys.argv[2], sys.argv[3], int(sys.argv[4])
    # Six 256-wide hidden layers: each stage's kernels form groups of equally shaped
    # matrices, large enough that jaxlib splits their factorisations across the pool.
    model = models.create("mlp", num_classes=10, input_shape=(8, 8, 1),
                          widths=(256,) * 6)
    x = np.zeros((1, 8, 8, 1), np.float32)
    stages = partition.split(model, 2, "uniform", example_input=x)
    params, model_states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
    loss = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    devices = None if engine == "fused" else [jax.devices()[k % jax.device_count()]
                                              for k in range(2)]
    schedule = fdg_jax.fdg(stages, loss, optimizers.basis_rotation(1e-3, frequency=2),
                           devices=devices)
    state = schedule.init(params, model_states)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(ticks, 32, 8, 8, 1)).astype(np.float32)
    ys = rng.integers(0, 10, size=(ticks, 32)).astype(np.int32)
    if call == "run":
      state, metrics = schedule.run(state, (xs, ys))
    else:
      for t in range(ticks):
        state, metrics = schedule.step(state, (xs[t], ys[t]))
    loss = float(np.asarray(metrics["loss"]).reshape(-1)[-1])
    assert np.isfinite(loss), loss
    print("finished", loss)
""")


def run_child(devices: int, engine: str, call: str, ticks: int, timeout: float):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  try:
    out = subprocess.run([sys.executable, "-c", CHILD, str(devices), engine, call, str(ticks)],
                         env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    pytest.fail(f"{ticks} ticks of {call} on {devices} CPU device(s), {engine} engine, did "
                f"not finish within {timeout} s (wedged)")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "finished" in out.stdout


@pytest.mark.parametrize("devices", [1, 2])
def test_basis_rotation_run_does_not_wedge(devices):
  run_child(devices, "fused", "run", 50, timeout=180)
