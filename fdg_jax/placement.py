"""Where each stage lives: one device per stage, or one column of a (data, stage) mesh.

A `Placement` answers two questions for stage k: where its state (parameters, optimizer
state, stash) lives, and where the batch-major tensors it consumes (activations, labels,
cotangents) live. With a device list both are that one device. With a mesh of axes
("data", "stage") of shape (R, K), stage k's state is replicated over the R devices of
column k and batch-major tensors are sharded over them along their leading axis, so jit
inserts the gradient all-reduce across the R data-parallel replicas.

The same code runs single-controller (one process sees every device) and multi-controller
(`jax.distributed.initialize`: every process runs the same program and sees only its own
devices). In the multi-controller case host data given to `put_batch` is this process's
slice of the global batch, and messages between stages are moved shard by shard between
each process's own devices (`move`), because JAX refuses a cross-host `device_put` between
two different device sets.
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
      processes = np.vectorize(lambda d: d.process_index)(mesh.devices)
      if (processes != processes[:, :1]).any():
        # Messages move shard by shard within a process (see `move`); JAX (0.10) refuses a
        # device_put between different device sets of different processes.
        raise ValueError("each replica's stages (a row of the mesh) must lie in one process; "
                         "build the mesh with fdg_jax.runtime.make_mesh")
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

  @property
  def single_device(self):
    """The one device every stage lives on, or None (stages apart, or a mesh)."""
    devices = {d for s in self.state_shardings + self.batch_shardings for d in s.device_set}
    if len(devices) != 1 or self.num_replicas != 1:
      return None
    device = next(iter(devices))
    return device if device.process_index == jax.process_index() else None

  # ------------------------------------------------------------------ shardings
  def message_sharding(self, k: int, leaf) -> jax.sharding.Sharding:
    """Where a batch-major leaf (or a scalar, replicated) consumed by stage k lives."""
    return self.batch_shardings[k] if np.ndim(leaf) > 0 else self.scalar_shardings[k]

  def message_shardings(self, k: int, tree):
    """`message_sharding` for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: self.message_sharding(k, a), tree)

  def buffer_sharding(self, k: int, batch_axis: int | None) -> jax.sharding.Sharding:
    """Sharding of a stage-k buffer whose batch axis is `batch_axis` (None: not batch-major).

    Stash leaves that hold activations are sharded along their batch axis, like the
    activations they keep, so each replica stores only its own part of the batch; the rest
    (weights kept by the vjp, statistics) is replicated like the stage state.
    """
    state = self.state_shardings[k]
    if batch_axis is None or not isinstance(state, NamedSharding):
      return state
    return NamedSharding(state.mesh, P(*([None] * batch_axis), DATA_AXIS))

  def local_batch_slice(self, global_batch_size: int) -> slice:
    """The rows of the global batch this process feeds to `put_batch(0, ...)`.

    All rows in a single process; with several processes, the rows held by this process's
    devices of stage 0 (a contiguous block, in the order of the mesh's "data" axis).
    """
    s = self.batch_shardings[0]
    rows = set()
    for idx in s.addressable_devices_indices_map((global_batch_size,)).values():
      rows.update(range(*idx[0].indices(global_batch_size)))
    if not rows:
      return slice(0, 0)
    lo, hi = min(rows), max(rows) + 1
    if hi - lo != len(rows):
      raise ValueError("this process's devices hold a non-contiguous part of the batch; "
                       "order the mesh's data axis by process (see fdg_jax.runtime.make_mesh)")
    return slice(lo, hi)

  # ------------------------------------------------------------------ moving data
  def put_state(self, k: int, tree):
    """Commits a pytree of stage state (replicated) to stage k's devices, as a copy.

    In a multi-controller run every process must pass the same values (as with identical
    seeds); each process writes only its own devices.
    """
    sharding = self.state_shardings[k]
    if sharding.is_fully_addressable:
      # The state is donated at every tick, so it must not share the caller's buffers; but
      # replicating over several devices, device_put(may_alias=False) still lets one
      # replica alias its input (jax 0.10). Copy first.
      tree = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)
      return jax.device_put(tree, sharding, may_alias=False)
    return jax.tree.map(lambda a: _put_replicated(a, sharding), tree)

  def put_batch(self, k: int, tree):
    """Moves batch-major arrays to stage k: leading axis sharded, scalars replicated.

    Device arrays (messages between stages) are moved with `move`. Host data (numpy) in a
    multi-controller run is this process's slice of the global batch (`local_batch_slice`).
    """
    shardings = self.message_shardings(k, tree)
    if self.batch_shardings[k].is_fully_addressable:
      return put_local(tree, shardings)

    def put(a, s):
      if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return move(a, s)
      if np.ndim(a) == 0:
        return _put_replicated(a, s)
      return jax.make_array_from_process_local_data(s, np.asarray(a))
    return jax.tree.map(put, tree, shardings)

  def put_replicated(self, k: int, tree):
    """Moves device arrays to stage k's devices, replicated there (like its state)."""
    sharding = self.state_shardings[k]
    if sharding.is_fully_addressable:
      return put_local(tree, jax.tree.map(lambda _: sharding, tree))
    return jax.tree.map(lambda a: move(a, sharding), tree)

  def put_batches(self, messages):
    """`[put_batch(k, tree) for k, tree in messages]`, as one batched move where possible."""
    messages = list(messages)
    if all(self.batch_shardings[k].is_fully_addressable for k, _ in messages):
      shardings = [self.message_shardings(k, tree) for k, tree in messages]
      return put_local([tree for _, tree in messages], shardings)
    return [self.put_batch(k, tree) for k, tree in messages]


def put_local(tree, shardings):
  """`jax.device_put(tree, shardings)` within one process, with less host time per leaf.

  Leaves already where they belong are kept; device arrays go to their target in one
  batched copy between devices (the C++ call JAX itself uses for cross-host copies, about
  5x less host time per leaf than `jax.device_put` here) where the source and target
  shardings have the same shape; the rest (host data, reshardings) through `device_put`.
  """
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(shardings)
  out: list = list(leaves)
  copy_idx, put_idx = [], []
  for i, (a, s) in enumerate(zip(leaves, targets)):
    if isinstance(a, jax.Array) and a.committed and a.sharding.is_equivalent_to(s, a.ndim):
      continue
    (copy_idx if _copyable(a, s) else put_idx).append(i)
  if copy_idx:
    moved = _batched_copy([leaves[i] for i in copy_idx], [targets[i] for i in copy_idx])
    for i, m in zip(copy_idx, moved):
      out[i] = m
  if put_idx:
    moved = jax.device_put([leaves[i] for i in put_idx], [targets[i] for i in put_idx])
    for i, m in zip(put_idx, moved):
      out[i] = m
  return treedef.unflatten(out)


def _copyable(a, target) -> bool:
  """Whether `a` can move to `target` shard for shard (same sharding but for devices)."""
  if _BATCHED_COPY is None or not isinstance(a, jax.Array) or not a.is_fully_addressable:
    return False
  src = a.sharding
  if isinstance(src, SingleDeviceSharding) and isinstance(target, SingleDeviceSharding):
    return True
  return (isinstance(src, NamedSharding) and isinstance(target, NamedSharding)
          and src.spec == target.spec and src.mesh.devices.shape == target.mesh.devices.shape
          and src.mesh.axis_names == target.mesh.axis_names)


def _find_batched_copy():
  try:
    from jax._src.lib import xla_client as xc
    fn = xc.batched_copy_array_to_devices_with_sharding
    always = xc.ArrayCopySemantics.ALWAYS_COPY
  except (ImportError, AttributeError):  # another JAX version: device_put does it all
    return None

  def copy(arrays, shardings):
    return fn(arrays, [s._internal_device_list for s in shardings], shardings,
              [always] * len(arrays))
  return copy


_BATCHED_COPY = _find_batched_copy()


def _batched_copy(arrays, shardings):
  # An explicit move, like device_put: not what a transfer guard is there to catch.
  with jax.transfer_guard_device_to_device("allow"):
    return _BATCHED_COPY(arrays, shardings)


def move(a: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """`a` with `sharding`: `jax.device_put` when this process holds all of both.

  Otherwise (multi-controller) each target device this process holds receives the local
  shard of `a` with the same index, copied between the process's own devices, and the
  global array is reassembled from them; nothing crosses a process boundary. That is the
  case of a (data, stage) mesh whose rows each lie within one process.
  """
  if a.is_fully_addressable and sharding.is_fully_addressable:
    return jax.device_put(a, sharding)
  return move_shards(a, sharding)


def move_shards(a: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """The shard-by-shard move of `move` (usable in one process too, e.g. in tests)."""
  if a.sharding == sharding:
    return a
  shape = a.shape
  local = {}
  for shard in a.addressable_shards:
    local.setdefault(_index_key(shard.index, shape), shard.data)
  targets = sharding.addressable_devices_indices_map(shape)
  pieces, devices = [], []
  for device, index in targets.items():
    piece = local.get(_index_key(index, shape))
    if piece is None:
      raise ValueError(
          f"cannot move an array of shape {shape} from {a.sharding} to {sharding}: this "
          f"process holds no shard with index {index} for {device}. Each stage-to-stage "
          "move must stay within a process; lay the mesh out so that every replica's K "
          "stages live in one process (fdg_jax.runtime.make_mesh does).")
    pieces.append(piece)
    devices.append(device)
  # One batched, explicit device-to-device copy for all local shards.
  moved = jax.device_put(pieces, devices)
  return jax.make_array_from_single_device_arrays(shape, sharding, moved)


def _index_key(index, shape):
  """A hashable form of a shard index (a tuple of slices)."""
  return tuple(s.indices(n) for s, n in zip(index, shape))


def _put_replicated(a, sharding):
  """`a` replicated over a sharding that spans several processes (same value in each)."""
  if isinstance(a, jax.Array) and not a.is_fully_addressable:
    return move(a, sharding)
  if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
    data = _put_replicated(jax.random.key_data(a), sharding)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
  host = np.asarray(jax.device_get(a))
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx],
                                      dtype=host.dtype)


def make_mesh(num_replicas: int, num_stages: int, devices: Sequence[Any] | None = None) -> Mesh:
  """A ("data", "stage") mesh of shape (R, K) whose rows stay within one process if they can.

  Devices are ordered by (process, id) and filled row by row, so with P processes of
  L devices each and K dividing L, replica r's K stages share a process: every stage-to-
  stage move is then local, and only the gradient all-reduce of a stage (down a column)
  crosses processes.
  """
  devices = list(jax.devices() if devices is None else devices)
  need = num_replicas * num_stages
  if len(devices) < need:
    raise ValueError(f"{num_replicas} replicas x {num_stages} stages need {need} devices, "
                     f"found {len(devices)}")
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))[:need]
  grid = np.asarray(devices, dtype=object).reshape(num_replicas, num_stages)
  return Mesh(grid, (DATA_AXIS, STAGE_AXIS))
