"""Where each stage lives: one device per stage, or one column of a (data, stage) mesh.

A `Placement` answers two questions for stage k: where its state (parameters, optimizer
state, stash) lives, and where the batch-major tensors it consumes (activations, labels,
cotangents) live. With a device list both are that one device. With a mesh of axes
("data", "stage") of shape (R, K), stage k's state is replicated over the R devices of
column k and batch-major tensors are sharded over them along their leading axis, so jit
inserts the gradient all-reduce across the R data-parallel replicas.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

DATA_AXIS = "data"
STAGE_AXIS = "stage"


class Placement:
  """Per-stage shardings for K stages.

  Build it with `Placement.create(num_stages, devices=None, mesh=None)`.
  """

  def __init__(self, state_shardings: Sequence[jax.sharding.Sharding],
               batch_shardings: Sequence[jax.sharding.Sharding],
               scalar_shardings: Sequence[jax.sharding.Sharding], num_replicas: int = 1):
    self.state_shardings = list(state_shardings)
    self.batch_shardings = list(batch_shardings)
    self.scalar_shardings = list(scalar_shardings)
    self.num_replicas = num_replicas

  @classmethod
  def create(cls, num_stages: int, devices: Sequence[Any] | None = None,
             mesh: Mesh | None = None) -> "Placement":
    """One device per stage (`devices`), all on the default device (neither), or a mesh.

    Args:
      num_stages: K.
      devices: None (every stage on `jax.devices()[0]`) or a sequence of K devices.
      mesh: a `jax.sharding.Mesh` with axes ("data", "stage") and shape (R, K).
    """
    if devices is not None and mesh is not None:
      raise ValueError("pass either devices or mesh, not both")
    if mesh is not None:
      if tuple(mesh.axis_names) != (DATA_AXIS, STAGE_AXIS):
        raise ValueError(f"mesh axes must be ('data', 'stage'), got {mesh.axis_names}")
      if mesh.devices.shape[1] != num_stages:
        raise ValueError(
            f"mesh has {mesh.devices.shape[1]} stage columns but the model has {num_stages} "
            "stages")
      state, batch = [], []
      for k in range(num_stages):
        sub = Mesh(mesh.devices[:, k], (DATA_AXIS,))
        state.append(NamedSharding(sub, P()))
        batch.append(NamedSharding(sub, P(DATA_AXIS)))
      return cls(state, batch, state, num_replicas=mesh.devices.shape[0])
    if devices is None:
      devices = [jax.devices()[0]] * num_stages
    devices = list(devices)
    if len(devices) != num_stages:
      raise ValueError(f"got {len(devices)} devices for {num_stages} stages")
    shardings = [SingleDeviceSharding(d) for d in devices]
    return cls(shardings, shardings, shardings)

  @property
  def num_stages(self) -> int:
    return len(self.state_shardings)

  def put_state(self, k: int, tree):
    """Commits a pytree of stage state (replicated) to stage k's devices, as a copy."""
    return jax.device_put(tree, self.state_shardings[k], may_alias=False)

  def put_batch(self, k: int, tree):
    """Moves batch-major arrays to stage k: leading axis sharded, scalars replicated."""
    def put(a):
      s = self.batch_shardings[k] if np.ndim(a) > 0 else self.scalar_shardings[k]
      return jax.device_put(a, s)
    return jax.tree.map(put, tree)
