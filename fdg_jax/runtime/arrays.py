"""Reading and checkpointing arrays that live in some processes only.

In a pipeline that spans processes, stage k's arrays have shards in the processes holding
its devices only; the others see them without shards. Two things then need care:

- `fetch(tree)`: the values on the host of every process (losses, metrics, logits, the
  parameters at the end), where each array may live in any subset of the processes;
- `to_checkpoint` / `from_checkpoint`: orbax refuses, in a multi-process run, an array
  that one process holds entirely (it takes it for a per-host array). Such an array is
  checkpointed as a view replicated over its own devices plus one device of another
  process, holding zeros there; the owner's copy is the one orbax writes (replica 0,
  with orbax's replica-parallel writing turned off by `single_replica_writes`).

Every process must call these with the same tree, in the same order: what each one does
is decided from the shardings alone (known alike everywhere), and they meet in
collectives where a value crosses processes. In a single-process run they reduce to
`np.asarray` and the identity.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


_ARRAYS = (jax.Array, jax.ShapeDtypeStruct)


def _processes(a) -> set[int]:
  return {d.process_index for d in a.sharding.device_set}


def fetch(tree):
  """Host numpy copies of every array of `tree` in every process (others pass through).

  Row-sharded arrays are first gathered within their own devices; an array that not
  every process holds is then broadcast from the first process holding it.
  """
  leaves, treedef = jax.tree.flatten(tree)
  if jax.process_count() == 1:
    return treedef.unflatten([np.asarray(a) if isinstance(a, jax.Array) else a
                              for a in leaves])
  from jax.experimental import multihost_utils
  out = list(leaves)
  by_source: dict = {}
  everyone = set(range(jax.process_count()))
  me = jax.process_index()
  for i, a in enumerate(leaves):
    if not isinstance(a, jax.Array):
      continue
    if not a.sharding.is_fully_replicated:
      a = _replicate(a)
    owners = _processes(a)
    if me in owners:
      out[i] = np.asarray(a.addressable_data(0))
    if owners != everyone:
      by_source.setdefault(min(owners), []).append(i)
  for source in sorted(by_source):
    idx = by_source[source]
    values = [out[i] if me == source else np.zeros(leaves[i].shape, leaves[i].dtype)
              for i in idx]
    values = multihost_utils.broadcast_one_to_all(values, is_source=me == source)
    for i, v in zip(idx, values):
      out[i] = np.asarray(v)
  return treedef.unflatten(out)


_REPLICATE: dict = {}


def _replicate(a: jax.Array) -> jax.Array:
  """`a` replicated over its own devices (an all-gather among the processes holding it)."""
  sharding = a.sharding
  if not isinstance(sharding, NamedSharding):
    raise ValueError(f"cannot gather an array with sharding {sharding}")
  target = NamedSharding(sharding.mesh, P())
  if target not in _REPLICATE:
    _REPLICATE[target] = jax.jit(lambda x: x, out_shardings=target)
  return _REPLICATE[target](a)


def _ghost_device(owner: int):
  """The device that holds the zero copy of an array owned by process `owner`."""
  others = [d for d in jax.devices() if d.process_index != owner]
  return min(others, key=lambda d: (d.process_index, d.id))


def _needs_view(a) -> bool:
  return (isinstance(a, _ARRAYS) and jax.process_count() > 1
          and len(_processes(a)) == 1)


def _view_sharding(a) -> NamedSharding:
  devices = sorted(a.sharding.device_set, key=lambda d: d.id)
  owner = devices[0].process_index
  return NamedSharding(Mesh(np.asarray([devices[0], _ghost_device(owner)], dtype=object),
                            ("copy",)), P())


def single_replica_writes() -> None:
  """Makes orbax write each replicated array from its replica 0 alone (its default on CPU
  and TPU splits the writing over the replicas, which would write a view's zeros)."""
  import orbax.checkpoint as ocp
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


def to_checkpoint(tree):
  """`tree` with every array held by one process only replaced by its checkpoint view."""
  me = jax.process_index()

  def view(a):
    if not _needs_view(a):
      return a
    sharding = _view_sharding(a)
    first, ghost = sharding.mesh.devices.reshape(-1)
    blocks = []
    if first.process_index == me:
      # One replica's copy, or the row-sharded array gathered, onto `first`.
      value = a.addressable_data(0) if a.sharding.is_fully_replicated else a
      blocks.append(jax.device_put(value, first))
    if ghost.process_index == me:
      blocks.append(jax.device_put(np.zeros(a.shape, a.dtype), ghost))
    return jax.make_array_from_single_device_arrays(a.shape, sharding, blocks, dtype=a.dtype)
  return jax.tree.map(view, tree)


def checkpoint_target(target):
  """The restore target of `to_checkpoint(target)`: ShapeDtypeStructs with shardings
  (`target` holds arrays or ShapeDtypeStructs with shardings)."""
  def spec(a):
    sharding = _view_sharding(a) if _needs_view(a) else a.sharding
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  return jax.tree.map(lambda a: spec(a) if isinstance(a, _ARRAYS) else a, target)


def from_checkpoint(restored, target):
  """The restored views put back where `target`'s arrays live."""
  me = jax.process_index()

  def back(r, t):
    if not _needs_view(t):
      return r
    first = _view_sharding(t).mesh.devices.reshape(-1)[0]
    if first.process_index != me:
      return jax.make_array_from_single_device_arrays(t.shape, t.sharding, [], dtype=t.dtype)
    value = next(shard.data for shard in r.addressable_shards if shard.device == first)
    return jax.device_put(value, t.sharding)
  return jax.tree.map(back, restored, target)
