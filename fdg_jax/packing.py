"""A stage's state packed into a few flat buffers, so that a jitted call carries few leaves.

The host cost of a jitted call grows with the number of pytree leaves it takes and returns
(about 1 us per leaf); a ResNet-110 stage's state (parameters, optimizer state, BatchNorm
statistics, the stash) has 500+. The schedules therefore keep every stage's state packed:
the leaves of one dtype concatenated into one flat buffer per group, unpacked by static
slices and reshapes at the start of a jitted call (free inside XLA) and packed again at its
end. A call then carries a handful of buffers whatever the model.

A `Layout` is the map between a pytree and its buffers. A leaf whose batch axis is sharded
over data-parallel replicas (a stash activation under a (data, stage) mesh) goes to a
"batch" group instead: batch axis first, then flattened, so the group is [B, N] and stays
sharded along B. Leaves of dtypes that cannot be concatenated (typed PRNG keys) stay as
they are, one buffer each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
BATCH_SUFFIX = "/batch"


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one pytree structure maps to flat buffers.

  Attributes:
    treedef: the pytree structure.
    shapes, dtypes: per leaf.
    batch_axes: per leaf, the axis sharded over replicas (None: not batch-major).
    groups: (buffer name, leaf indices) in buffer order.
  """

  treedef: Any
  shapes: tuple
  dtypes: tuple
  batch_axes: tuple
  groups: tuple

  @classmethod
  def of(cls, tree: PyTree, batch_axes: Sequence[int | None] | None = None) -> "Layout":
    """The layout of `tree` (arrays or ShapeDtypeStructs); `batch_axes` per leaf, optional."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(np.shape(a)) for a in leaves)
    dtypes = tuple(jnp.dtype(a.dtype) for a in leaves)
    batch_axes = tuple(batch_axes) if batch_axes is not None else (None,) * len(leaves)
    if len(batch_axes) != len(leaves):
      raise ValueError(f"{len(batch_axes)} batch axes for {len(leaves)} leaves")
    groups: dict[str, list[int]] = {}
    for i, (dt, ax) in enumerate(zip(dtypes, batch_axes)):
      if not _packable(dt):
        groups[f"leaf{i}"] = [i]
        continue
      name = dt.name + (BATCH_SUFFIX if ax is not None else "")
      groups.setdefault(name, []).append(i)
    return cls(treedef, shapes, dtypes, batch_axes,
               tuple((name, tuple(idx)) for name, idx in groups.items()))

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.groups)

  def is_batch(self, name: str) -> bool:
    return name.endswith(BATCH_SUFFIX)

  def buffer_specs(self) -> dict:
    """ShapeDtypeStructs of the buffers."""
    out = {}
    for name, idx in self.groups:
      dt = self.dtypes[idx[0]]
      if name.startswith("leaf"):
        out[name] = jax.ShapeDtypeStruct(self.shapes[idx[0]], dt)
      elif self.is_batch(name):
        b = self.shapes[idx[0]][self.batch_axes[idx[0]]]
        n = sum(int(np.prod(self.shapes[i])) // b for i in idx)
        out[name] = jax.ShapeDtypeStruct((b, n), dt)
      else:
        out[name] = jax.ShapeDtypeStruct((sum(int(np.prod(self.shapes[i])) for i in idx),), dt)
    return out

  def pack(self, tree: PyTree) -> dict:
    """The buffers of `tree` (works traced and eagerly)."""
    leaves = self.treedef.flatten_up_to(tree)
    out = {}
    for name, idx in self.groups:
      if name.startswith("leaf"):
        out[name] = leaves[idx[0]]
      elif self.is_batch(name):
        parts = [jnp.moveaxis(leaves[i], self.batch_axes[i], 0) for i in idx]
        parts = [p.reshape(p.shape[0], -1) for p in parts]
        out[name] = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
      else:
        parts = [jnp.ravel(leaves[i]) for i in idx]
        out[name] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return out

  def unpack(self, buffers: dict) -> PyTree:
    """The pytree held in `buffers` (static slices and reshapes)."""
    leaves: list = [None] * len(self.shapes)
    for name, idx in self.groups:
      buf = buffers[name]
      if name.startswith("leaf"):
        leaves[idx[0]] = buf
        continue
      batch = self.is_batch(name)
      offset = 0
      for i in idx:
        shape = self.shapes[i]
        if batch:
          ax = self.batch_axes[i]
          moved = (shape[ax],) + shape[:ax] + shape[ax + 1:]
          n = int(np.prod(moved[1:]))
          part = buf[:, offset:offset + n].reshape(moved)
          leaves[i] = jnp.moveaxis(part, 0, ax)
        else:
          n = int(np.prod(shape))
          leaves[i] = buf[offset:offset + n].reshape(shape)
        offset += n
    return self.treedef.unflatten(leaves)


def _packable(dtype) -> bool:
  return not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
