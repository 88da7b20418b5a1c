"""A stage's state packed into a few flat buffers, so that a jitted call carries few leaves.

The host cost of a jitted call grows with the number of pytree leaves it takes and returns
(about 1 us per leaf); a ResNet-110 stage's parameters, optimizer state and BatchNorm
statistics are hundreds. The schedules therefore keep that part of every stage's state
packed: the leaves of one dtype concatenated into one flat buffer, unpacked by static slices
and reshapes at the start of a jitted call (free inside XLA) and packed again at its end (one
copy of the parameters and optimizer state, small next to a tick's compute).

A `Layout` is the map between a pytree and its buffers. Leaves of dtypes that cannot be
concatenated (typed PRNG keys) stay as they are, one buffer each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one pytree structure maps to flat buffers.

  Attributes:
    treedef: the pytree structure.
    shapes, dtypes: per leaf.
    groups: (buffer name, leaf indices) in buffer order; the name is the dtype's, or
      `leaf{i}` for a leaf kept as it is.
  """

  treedef: Any
  shapes: tuple
  dtypes: tuple
  groups: tuple

  @classmethod
  def of(cls, tree: PyTree) -> "Layout":
    """The layout of `tree` (arrays or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(np.shape(a)) for a in leaves)
    dtypes = tuple(jnp.dtype(a.dtype) for a in leaves)
    groups: dict[str, list[int]] = {}
    for i, dt in enumerate(dtypes):
      name = f"leaf{i}" if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key) else dt.name
      groups.setdefault(name, []).append(i)
    return cls(treedef, shapes, dtypes, tuple((n, tuple(idx)) for n, idx in groups.items()))

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.groups)

  @property
  def sizes(self) -> dict[str, int]:
    """Each concatenated buffer's length (buffers of a kept leaf are left out)."""
    return {name: sum(int(np.prod(self.shapes[i])) for i in idx)
            for name, idx in self.groups if not name.startswith("leaf")}

  @property
  def offsets(self) -> tuple[int, ...]:
    """Where each leaf starts in its buffer."""
    out = [0] * len(self.shapes)
    for _, idx in self.groups:
      at = 0
      for i in idx:
        out[i] = at
        at += int(np.prod(self.shapes[i]))
    return tuple(out)

  def pack(self, tree: PyTree, lengths: dict | None = None) -> dict:
    """The buffers of `tree` (works traced and eagerly); with `lengths`, one buffer per
    name there, zero-padded to that length (zeros for a name `tree` lacks)."""
    leaves = self.treedef.flatten_up_to(tree)
    out = {}
    for name, idx in self.groups:
      if name.startswith("leaf"):
        out[name] = leaves[idx[0]]
        continue
      parts = [jnp.ravel(leaves[i]) for i in idx]
      out[name] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    if lengths is None:
      return out
    return {name: pad(out.get(name), n, name) for name, n in lengths.items()}

  def write(self, buffers: dict, tree: PyTree, at: dict, where=True) -> dict:
    """`buffers` with `tree`'s leaves written in place from position `at[name]` of each
    (traced positions allowed): `pack` and a dynamic update, without the packed copy.
    With a traced `where`, a leaf is written only where it holds, else its old value is
    kept; each old value is read from the buffer as the previous leaves left it, so every
    read comes before the update that follows it (else XLA copies the buffer)."""
    leaves = self.treedef.flatten_up_to(tree)
    offsets, out = self.offsets, dict(buffers)
    for name, idx in self.groups:
      for i in idx:
        start = (at[name] + offsets[i],)
        new = jnp.ravel(leaves[i]).astype(out[name].dtype)
        if where is not True:
          new = jnp.where(where, new, jax.lax.dynamic_slice(out[name], start, new.shape))
        out[name] = jax.lax.dynamic_update_slice(out[name], new, start)
    return out

  def unpack(self, buffers: dict) -> PyTree:
    """The pytree held in `buffers` (static slices and reshapes; longer buffers are fine)."""
    leaves: list = [None] * len(self.shapes)
    offsets = self.offsets
    for name, idx in self.groups:
      buf = buffers[name]
      if name.startswith("leaf"):
        leaves[idx[0]] = buf
        continue
      for i in idx:
        n = int(np.prod(self.shapes[i]))
        leaves[i] = buf[offsets[i]:offsets[i] + n].reshape(self.shapes[i])
    return self.treedef.unflatten(leaves)

  def unpack_slots(self, buffers: dict, num_slots: int) -> PyTree:
    """The pytree of `num_slots` entries held slot after slot in `buffers` (a flat ring),
    each leaf with a leading [num_slots] axis (longer buffers are fine)."""
    rows = {name: buffers[name][:num_slots * n].reshape(num_slots, n)
            for name, n in self.sizes.items()}
    return jax.vmap(self.unpack)(rows)


def pad(buffer, length: int, dtype):
  """`buffer` (or nothing: zeros) zero-padded to `length`."""
  if buffer is None:
    return jnp.zeros((length,), dtype)
  if buffer.shape[0] == length:
    return buffer
  return jnp.concatenate([buffer, jnp.zeros((length - buffer.shape[0],), buffer.dtype)])
