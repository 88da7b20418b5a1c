"""Where each stage lives: one device per stage, or one column of a (data, stage) mesh.

A `Placement` answers two questions for stage k: where its state (parameters, optimizer
state, stash) lives, and where the batch-major tensors it consumes (activations, labels,
cotangents) live. With a device list both are that one device. With a mesh of axes
("data", "stage") of shape (R, K), stage k's state is replicated over the R devices of
column k and batch-major tensors are sharded over them along their leading axis, so jit
inserts the gradient all-reduce across the R data-parallel replicas.

The same code runs single-controller (one process sees every device) and multi-controller
(`jax.distributed.initialize`: every process runs the same program and sees only its own
devices). In the multi-controller case host data given to `put_batch(0, ...)` is this
process's slice of the global batch (`local_batch_slice`; a process holding none of stage
0's devices passes arrays of the global shape, which are not read). A message between two
stages moves shard by shard between a process's own devices where the two stages' shards
of every replica lie in one process; where they lie in different processes (a pipeline
that spans processes) it crosses through a collective (`exchange`: a two-sided `ppermute`
program over the source and target devices), because JAX refuses a `device_put` between
device sets of different processes. Every process calls the same moves in the same order
(the tick is the same program everywhere), and which kind of move runs is decided from the
shardings alone, so the processes always meet in the same collectives.
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
    self._plans: dict = {}  # `_MovePlan`s of `put_batches`, by the messages' layout

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
      return cls._columns([mesh.devices[:, k] for k in range(num_stages)])
    if devices is None:
      devices = [jax.devices()[0]] * num_stages
    devices = list(devices)
    if len(devices) != num_stages:
      raise ValueError(f"got {len(devices)} devices for {num_stages} stages")
    if len({d.process_index for d in devices}) > 1:
      # Stages in several processes: one-device meshes, whose arrays a multi-process
      # checkpoint (orbax) and the cross-process moves handle like a mesh column's.
      return cls._columns([np.asarray([d], dtype=object) for d in devices])
    shardings = [SingleDeviceSharding(d) for d in devices]
    return cls(shardings, shardings, shardings)

  @classmethod
  def _columns(cls, columns) -> "Placement":
    """Stage k on the devices `columns[k]` (its R replicas), as a ("data",) mesh."""
    state, batch = [], []
    for column in columns:
      sub = Mesh(np.asarray(column, dtype=object), (DATA_AXIS,))
      state.append(NamedSharding(sub, P()))
      batch.append(NamedSharding(sub, P(DATA_AXIS)))
    return cls(state, batch, state, num_replicas=len(columns[0]))

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

  @property
  def spans_processes(self) -> bool:
    """Whether some replica's stages lie in different processes (a pipeline across them)."""
    rows = zip(*[[d.process_index for d in _devices(s)] for s in self.state_shardings])
    return any(len(set(row)) > 1 for row in rows)

  def feeder(self) -> tuple[int, int] | None:
    """(index, count) of this process among those holding stage 0's devices, or None.

    The feeders split every global batch into `count` equal blocks of rows, block `index`
    being this process's (`local_batch_slice`); the other processes feed nothing.
    """
    processes = sorted({d.process_index for d in _devices(self.batch_shardings[0])})
    if jax.process_index() not in processes:
      return None
    return processes.index(jax.process_index()), len(processes)

  def local_batch_slice(self, global_batch_size: int) -> slice:
    """The rows of the global batch this process feeds to `put_batch(0, ...)`.

    All rows in a single process; with several processes, the rows held by this process's
    devices of stage 0 (a contiguous block, in the order of the mesh's "data" axis), and
    slice(0, 0) in a process holding none of them.
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

    Device arrays (messages between stages) are moved with `move_tree`. Host data (numpy)
    in a multi-controller run is this process's slice of the global batch
    (`local_batch_slice`); a process holding none of stage k's devices passes arrays of the
    global shape (they are not read).
    """
    if jax.process_count() == 1:
      return self.put_batches([(k, tree)])[0]
    shardings = self.message_shardings(k, tree)
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(_put_global(leaves, treedef.flatten_up_to(shardings)))

  def put_replicated(self, k: int, tree):
    """Moves device arrays to stage k's devices, replicated there (like its state)."""
    sharding = self.state_shardings[k]
    if jax.process_count() == 1:
      return put_local(tree, jax.tree.map(lambda _: sharding, tree))
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten(move_tree(leaves, [sharding] * len(leaves)))

  def put_batches(self, messages):
    """`[put_batch(k, tree) for k, tree in messages]`, as one batched move where possible
    (in a multi-process run, one collective per pair of device sets crossed)."""
    messages = list(messages)
    leaves, treedef = jax.tree.flatten([tree for _, tree in messages])
    if jax.process_count() == 1:
      key = (treedef, tuple(k for k, _ in messages), tuple(map(_where, leaves)))
      plan = self._plans.get(key)
      if plan is None:
        if len(self._plans) >= 64:  # layouts seen once (the first ticks' placeholders)
          self._plans.clear()
        shardings = [self.message_shardings(k, tree) for k, tree in messages]
        plan = self._plans[key] = _MovePlan(leaves, treedef.flatten_up_to(shardings))
      return treedef.unflatten(plan(leaves))
    shardings = [self.message_shardings(k, tree) for k, tree in messages]
    return treedef.unflatten(_put_global(leaves, treedef.flatten_up_to(shardings)))


def _put_global(leaves: list, targets: list) -> list:
  """`put_batch`'s leaves in a multi-process run: device arrays moved (`move_tree`), host
  data assembled from this process's rows (or shapes only where it holds no device)."""
  out: list = [None] * len(leaves)
  moving = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array) and a.committed]
  for i, m in zip(moving, move_tree([leaves[i] for i in moving],
                                    [targets[i] for i in moving])):
    out[i] = m
  for i, (a, s) in enumerate(zip(leaves, targets)):
    if out[i] is not None:
      continue
    if np.ndim(a) == 0:
      out[i] = _put_replicated(a, s)
    elif not _holds(s):
      out[i] = _no_shards(np.shape(a), np.asarray(a).dtype, s)
    else:
      out[i] = jax.make_array_from_process_local_data(s, np.asarray(a))
  return out


def put_local(tree, shardings):
  """`jax.device_put(tree, shardings)` within one process, with less host time per leaf.

  Leaves already where they belong are kept; device arrays go to their target in one
  batched copy between devices (the C++ call JAX itself uses for cross-host copies, about
  5x less host time per leaf than `jax.device_put` here) where the source and target
  shardings have the same shape; the rest (host data, reshardings) through `device_put`.
  """
  leaves, treedef = jax.tree.flatten(tree)
  return treedef.unflatten(_MovePlan(leaves, treedef.flatten_up_to(shardings))(leaves))


def _where(leaf):
  """What `put_local` decides a leaf's move by: a device array's sharding (by identity; the
  outputs of one compiled program share theirs), whether it is committed and its rank (a
  scalar goes where stage k's scalars live), else its type and rank."""
  if isinstance(leaf, jax.Array):
    return id(leaf.sharding), leaf.committed, leaf.ndim
  return type(leaf), np.ndim(leaf)


class _MovePlan:
  """`put_local`'s decisions for one layout of leaves (`_where`), made once: which leaves
  stay, which go by the batched copy, which by `device_put`. Holds the leaves' shardings, so
  that the ids in its key stay theirs while it lives."""

  def __init__(self, leaves: list, targets: list):
    self.sources = [getattr(a, "sharding", None) for a in leaves]
    self.copy, self.put = [], []
    for i, (a, s) in enumerate(zip(leaves, targets)):
      if isinstance(a, jax.Array) and a.committed and a.sharding.is_equivalent_to(s, a.ndim):
        continue
      (self.copy if _copyable(a, s) else self.put).append((i, s))

  def __call__(self, leaves: list) -> list:
    out = list(leaves)
    for moves, fn in ((self.copy, _batched_copy), (self.put, jax.device_put)):
      if moves:
        moved = fn([leaves[i] for i, _ in moves], [s for _, s in moves])
        for (i, _), m in zip(moves, moved):
          out[i] = m
    return out


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
  """`a` with `sharding` (see `move_tree`)."""
  return move_tree([a], [sharding])[0]


def move_tree(arrays: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]) -> list:
  """Each array moved to its sharding, in any single- or multi-controller run.

  - one process holds all of both: `jax.device_put`;
  - else, where every shard's source and target devices lie in one process (a (data,
    stage) mesh whose rows each lie within one process): each process copies its own
    shards (`move_shards`), nothing crosses a process boundary;
  - else the shards cross processes through `exchange`, one collective program per pair
    of device sets.

  The choice depends on the shardings only, so every process takes the same one; every
  process must call this with the same arrays (those it holds no shards of included).
  """
  out: list = [None] * len(arrays)
  groups: dict = {}
  for i, (a, s) in enumerate(zip(arrays, shardings)):
    if a.sharding.is_fully_addressable and s.is_fully_addressable:
      out[i] = jax.device_put(a, s)
    elif _crosses(a.sharding, s):
      groups.setdefault(_sides([a.sharding, s]), []).append(i)
    else:
      out[i] = move_shards(a, s)
  for idx in groups.values():
    for i, m in zip(idx, exchange([arrays[i] for i in idx], [shardings[i] for i in idx])):
      out[i] = m
  return out


def _devices(sharding) -> list:
  """A sharding's devices in its mesh order (or its one device)."""
  if isinstance(sharding, NamedSharding):
    return list(sharding.mesh.devices.reshape(-1))
  return sorted(sharding.device_set, key=lambda d: d.id)


def _holds(sharding) -> bool:
  """Whether this process holds any of `sharding`'s devices."""
  return any(d.process_index == jax.process_index() for d in sharding.device_set)


def _no_shards(shape, dtype, sharding) -> jax.Array:
  """The global array of `sharding` as seen by a process that holds none of its devices."""
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def _sides(shardings) -> tuple:
  """The distinct device sets of `shardings` (each in mesh order), in a fixed order."""
  return tuple(sorted({tuple(_devices(s)) for s in shardings},
                      key=lambda devices: [d.id for d in devices]))


def _crosses(src, dst) -> bool:
  """Whether moving an array from `src` to `dst` (equal layouts) crosses processes: some
  shard's source device and target device (same position) lie in different processes."""
  a, b = _devices(src), _devices(dst)
  if len(a) != len(b):
    return True
  return any(x.process_index != y.process_index for x, y in zip(a, b))


EXCHANGE_AXES = ("side", DATA_AXIS)


def exchange(arrays: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> list:
  """Moves arrays between two sets of devices in different processes through a collective.

  Every array moves from one device set (a stage's devices) to the other (another stage's:
  as many devices, disjoint), in either direction: activations up and cotangents down
  travel in the same call. One jitted `shard_map` over the (2, R) mesh ("side": the two
  sets; "data": the replicas) sends each array's blocks to the devices at the same
  positions on the other side with `lax.ppermute` along "side". A batch-sharded leaf (rows
  over "data") is seen as a (2B, ...) array whose blocks are its shards on its side and
  zero blocks on the other; a replicated leaf (a scalar) keeps its shape with spec P() (the
  program checks no replication: each device's block is its own). Processes holding
  devices of either set run the program (every one of them must call this with the same
  arrays); the others get the arrays without shards.
  """
  sides = _sides([a.sharding for a in arrays] + list(shardings))
  if len(sides) != 2 or set(sides[0]) & set(sides[1]) or len(sides[0]) != len(sides[1]):
    raise ValueError("exchange moves arrays between two disjoint sets of as many devices")
  for a in arrays:
    if not (a.sharding.is_fully_replicated or _row_sharded(a.sharding, a.ndim)):
      raise ValueError(f"exchange moves replicated or row-sharded arrays, not {a.sharding}")
  me = jax.process_index()
  if not any(d.process_index == me for d in sides[0] + sides[1]):
    return [_no_shards(a.shape, a.dtype, s) for a, s in zip(arrays, shardings)]
  mesh = Mesh(np.asarray(sides, dtype=object), EXCHANGE_AXES)
  specs, directions, inputs = [], [], []
  for a in arrays:
    source = 0 if tuple(_devices(a.sharding)) == sides[0] else 1
    replicated = a.sharding.is_fully_replicated
    spec = P() if replicated else P(EXCHANGE_AXES)
    block = a.shape if replicated else (a.shape[0] // len(sides[0]),) + a.shape[1:]
    local = {shard.device: shard.data for shard in a.addressable_shards}
    blocks = [local[d] if side == source else _zero_block(block, a.dtype, d)
              for side in (0, 1) for d in sides[side] if d.process_index == me]
    shape = a.shape if replicated else (2 * a.shape[0],) + a.shape[1:]
    specs.append(spec)
    directions.append(source)
    inputs.append(jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, spec), blocks, dtype=a.dtype))
  outputs = _exchange_fn(mesh, tuple(specs), tuple(directions))(*inputs)
  moved = []
  for a, s, o, source in zip(arrays, shardings, outputs, directions):
    received = {shard.device: shard.data for shard in o.addressable_shards}
    moved.append(jax.make_array_from_single_device_arrays(
        a.shape, s, [received[d] for d in sides[1 - source] if d.process_index == me],
        dtype=a.dtype))
  return moved


def _row_sharded(sharding, ndim: int) -> bool:
  return (isinstance(sharding, NamedSharding) and ndim > 0
          and tuple(sharding.spec)[:1] == (DATA_AXIS,)
          and all(p is None for p in tuple(sharding.spec)[1:]))


_EXCHANGE_FNS: dict = {}
_ZERO_BLOCKS: dict = {}


def _exchange_fn(mesh: Mesh, specs: tuple, directions: tuple):
  """The jitted exchange program: block b goes from side directions[b] to the other."""
  key = (tuple(mesh.devices.reshape(-1)), specs, directions)
  if key not in _EXCHANGE_FNS:
    def send(*blocks):
      return tuple(jax.lax.ppermute(b, "side", [(d, 1 - d)])
                   for b, d in zip(blocks, directions))
    _EXCHANGE_FNS[key] = jax.jit(jax.shard_map(send, mesh=mesh, in_specs=specs,
                                               out_specs=specs, check_vma=False))
  return _EXCHANGE_FNS[key]


def _zero_block(shape, dtype, device) -> jax.Array:
  """A cached zero block (the target side's input of `exchange`, never donated)."""
  key = (tuple(shape), np.dtype(dtype).name, device)
  if key not in _ZERO_BLOCKS:
    _ZERO_BLOCKS[key] = jax.device_put(np.zeros(shape, dtype), device)
  return _ZERO_BLOCKS[key]


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
  moved = jax.device_put(pieces, devices) if pieces else []
  return jax.make_array_from_single_device_arrays(shape, sharding, moved, dtype=a.dtype)


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
