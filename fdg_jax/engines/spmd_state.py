"""The SPMD engine's state: each stage's state as padded flat vectors, and back.

Stages differ in shapes, while a switch's branches and a shard_map's blocks must agree, so
the SPMD engine holds a stage's state as one flat vector per dtype, padded to the largest
stage's size: its core state (the `Layout` buffers of the other engines), its stash ring (D
slots one after another), its incoming activation and its incoming cotangent, one after
another (`join`). `Vectors` knows those layouts (`layouts`, `tables`) and converts a state
between the other engines' layout and this one (`flatten`, `unflatten`, `core`), with data-
parallel replicas too (each replica's block its share of the batch's stash and messages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from fdg_jax.packing import Layout, pad as _pad

KINDS = ("core", "ring", "act", "cot")


def _layout(tree) -> Layout:
  """The `Layout` of `tree`, which must pack whole (every leaf in a dtype's buffer)."""
  layout = Layout.of(tree)
  if any(name.startswith("leaf") for name in layout.names):
    raise ValueError("engine='spmd' packs the state into flat buffers and cannot hold "
                     "typed PRNG keys; pass raw uint32 keys (jax.random.PRNGKey)")
  return layout


class Vectors:
  """The padded vectors of one SPMD schedule (its layouts known at the state's allocation).

  `columns`: per stage, its devices, replica by replica; `column_shardings`: where a stage's
  vectors lie (its device, or its column of replicas)."""

  def __init__(self, schedule, columns: list, column_shardings: list):
    self.shapes, self.math = schedule.shapes, schedule.math
    self.placement = schedule.placement
    self.ring_sizes = schedule.plan.ring_sizes
    self.num_stages = schedule.num_stages
    self.columns, self.column_shardings = columns, column_shardings
    self.replicas = len(columns[0])
    self._layout_cache = None
    self._local = None
    self.fns: dict = {}

  # ------------------------------------------------------------------ layouts
  def layouts(self):
    """(per stage and kind its `Layout`, per kind and dtype the padded length, per dtype the
    largest slot).

    A ring vector holds the largest stage's D_k slots, and room to write a slot of the
    largest size at any stage's last slot (the program writes that many elements).
    """
    if self._layout_cache is not None:
      return self._layout_cache
    s, K = self.shapes, self.num_stages
    entry_specs, act_specs, _ = self.local_specs()
    flats = []
    for k in range(K):
      core = _layout({name: jax.ShapeDtypeStruct((n,), name)
                      for name, n in _layout(s.core_spec(k)).sizes.items()})
      ring = _layout(tuple(entry_specs[k])) if k < K - 1 else None
      act = _layout(act_specs[k - 1]) if k > 0 else None
      cot = _layout(act_specs[k][0]) if k < K - 1 else None
      flats.append({"core": core, "ring": ring, "act": act, "cot": cot})
    lengths = {kind: {} for kind in KINDS}
    slots: dict[str, int] = {}
    for k, f in enumerate(flats):
      for kind in KINDS:
        if f[kind] is None:
          continue
        scale = self.ring_sizes[k] if kind == "ring" else 1
        for name, n in f[kind].sizes.items():
          lengths[kind][name] = max(lengths[kind].get(name, 0), scale * n)
          if kind == "ring":
            slots[name] = max(slots.get(name, 0), n)
    for name, n in slots.items():  # room to write the largest slot at any stage's last
      lengths["ring"][name] = max([lengths["ring"][name]] + [
          (self.ring_sizes[k] - 1) * f["ring"].sizes.get(name, 0) + n
          for k, f in enumerate(flats) if f["ring"] is not None])
    self._layout_cache = flats, lengths, slots
    return self._layout_cache

  def local_specs(self):
    """Per stage, what one device of the program holds: (stash entry specs, outgoing
    activation message specs, the stash's `stages.Residuals`). With one replica, the schedule's
    own; with R, those of a B/R batch (traced: the vjp's structure, e.g. the cotangent
    shapes it checks, follows the batch)."""
    s, K, R = self.shapes, self.num_stages, self.replicas
    if R == 1:
      return s.entry_specs, s.act_specs, s.stash_residuals
    if self._local is not None:
      return self._local
    x, y = s.batch_spec  # a multiple of R (`Shapes.prepare`)
    local = lambda a: jax.ShapeDtypeStruct((a.shape[0] // R,) + a.shape[1:], a.dtype)
    a, y = local(x), local(y)
    entries, acts, residuals = [None] * K, [None] * K, [None] * K
    for k in range(K - 1):  # no telemetry's extras: the engine takes no telemetry
      entries[k], residuals[k], a = s.entry_and_output(k, a, self.math)
      acts[k] = (a, y, jax.ShapeDtypeStruct((), jnp.int32))
    self._local = entries, acts, residuals
    return self._local

  def tables(self) -> dict:
    """Per-stage constants the program indexes by its stage: ring size, where the `pops`
    and `pushes` counters sit in the int32 core vector, and the slot size per dtype."""
    s, K = self.shapes, self.num_stages
    flats, _, slots = self.layouts()
    table = {"ring_size": [], "pops_at": [], "pushes_at": []}
    table.update({"slot_" + name: [] for name in slots})
    for k in range(K):
      lay = s.core_layouts[k]
      index = lay.treedef.unflatten(range(len(lay.shapes)))  # leaf index of each entry
      table["ring_size"].append(self.ring_sizes[k] if k < K - 1 else 1)
      table["pops_at"].append(lay.offsets[index["pops"]])  # both in the int32 buffer
      table["pushes_at"].append(lay.offsets[index["pushes"]])
      ring = flats[k]["ring"]
      for name in slots:
        table["slot_" + name].append(ring.sizes.get(name, 0) if ring is not None else 0)
    return {name: np.asarray(v, np.int32) for name, v in table.items()}

  def ring_bytes(self) -> int:
    """Bytes of one device's padded ring vectors."""
    _, lengths, _ = self.layouts()
    return sum(L * jnp.dtype(n).itemsize for n, L in lengths["ring"].items())

  # ------------------------------------------------------------------ state in and out
  def stack_fn(self, k: int):
    """Stage k's packed state and inbox -> its padded vectors (one per dtype), on its device."""
    key = ("stack", k)
    if key in self.fns:
      return self.fns[key]
    flats, lengths, _ = self.layouts()
    f, D = flats[k], self.ring_sizes[k]

    def stack(packed, box):
      out = {"core": f["core"].pack(packed["core"], lengths["core"])}
      ring = {}
      if f["ring"] is not None:  # [D, ...] per leaf -> slot after slot, per dtype
        rows = jax.vmap(f["ring"].pack)(tuple(packed["stash"]["ring"]))
        ring = {n: r.reshape(-1) for n, r in rows.items()}
      out["ring"] = {n: _pad(ring.get(n), L, n) for n, L in lengths["ring"].items()}
      for kind in ("act", "cot"):
        vec = f[kind].pack(box[kind]) if f[kind] is not None else {}
        out[kind] = {n: _pad(vec.get(n), L, n) for n, L in lengths[kind].items()}
      return join(out, lengths)

    fn = jax.jit(stack, out_shardings=self.column_shardings[k])
    self.fns[key] = fn
    return fn

  def start_fn(self, k: int):
    """With replicas: stage k's packed core -> its vectors on its column, each replica's
    block the core and zeros (the ring and inbox of a state just allocated)."""
    key = ("start", k)
    if key in self.fns:
      return self.fns[key]
    flats, lengths, _ = self.layouts()
    f, R = flats[k], self.replicas

    def start(core):
      out = {"core": f["core"].pack(core, lengths["core"])}
      for kind in ("ring", "act", "cot"):
        out[kind] = {n: jnp.zeros((L,), n) for n, L in lengths[kind].items()}
      return {n: jnp.tile(v, R) for n, v in join(out, lengths).items()}

    fn = jax.jit(start, out_shardings=self.column_shardings[k])
    self.fns[key] = fn
    return fn

  def gather_fn(self, k: int):
    """With replicas: the inverse of `start_fn` for any state, as the other engines lay it
    out: the core of replica 0 (the replicas' cores are equal), and each batch-major leaf of
    the stash and inbox the replicas' parts joined along its batch axis (a leaf that is not
    batch-major, e.g. a BatchNorm layer's batch statistics, is replica 0's)."""
    key = ("gather", k)
    if key in self.fns:
      return self.fns[key]
    s, R = self.shapes, self.replicas
    flats, lengths, _ = self.layouts()
    f, D = flats[k], self.ring_sizes[k]

    def concat(parts, axis):
      return parts[0] if axis is None else jnp.concatenate(parts, axis)

    def gather(vectors):
      rows = [part({n: v.reshape(R, -1)[r] for n, v in vectors.items()}, lengths)
              for r in range(R)]
      packed = {"core": f["core"].unpack(rows[0]["core"])}
      if f["ring"] is not None:
        rings = [f["ring"].unpack_slots(row["ring"], D) for row in rows]
        packed["stash"] = {"ring": tuple(
            concat(parts, None if ax is None else ax + 1)
            for parts, ax in zip(zip(*rings), s.stash_axes[k]))}
      box = {}
      for kind in ("act", "cot"):
        if f[kind] is not None:
          trees = [f[kind].unpack(row[kind]) for row in rows]
          box[kind] = jax.tree.map(lambda *parts: concat(parts, 0 if parts[0].ndim else None),
                                   *trees)
      return packed, box

    fn = jax.jit(gather)
    self.fns[key] = fn
    return fn

  def split_fn(self, k: int):
    """The inverse of `stack_fn`: stage k's packed state and inbox, sharded as before."""
    key = ("split", k)
    if key in self.fns:
      return self.fns[key]
    s = self.shapes
    flats, lengths, _ = self.layouts()
    f, D = flats[k], self.ring_sizes[k]

    def split(vectors):
      v = part(vectors, lengths)
      packed = {"core": f["core"].unpack(v["core"])}
      if f["ring"] is not None:  # slot after slot -> [D, ...] per leaf
        packed["stash"] = {"ring": tuple(f["ring"].unpack_slots(v["ring"], D))}
      box = {kind: f[kind].unpack(v[kind]) for kind in ("act", "cot") if f[kind] is not None}
      return packed, box

    P_ = self.placement
    box_shardings = {}
    if f["act"] is not None:
      box_shardings["act"] = P_.message_shardings(k, s.act_specs[k - 1])
    if f["cot"] is not None:
      box_shardings["cot"] = P_.message_shardings(k, s.act_specs[k][0])
    shardings = s.state_shardings(k)
    if "stash" in shardings:  # the ring alone: the SPMD program reads its slots itself
      shardings["stash"] = {"ring": shardings["stash"]["ring"]}
    fn = jax.jit(split, out_shardings=(shardings, box_shardings))
    self.fns[key] = fn
    return fn

  # ------------------------------------------------------------------ state
  def flatten(self, state):
    """A state in the per-stage layout of the other engines -> this engine's (consumed)."""
    K = self.num_stages
    stages = []
    for k in range(K):
      if self.replicas == 1:
        stages.append({"flat": self.stack_fn(k)(state["stages"][k], state["inbox"][k])})
      else:  # from an allocated state (zero stash and inbox), as `Shapes.allocate` gives
        stages.append({"flat": self.start_fn(k)(state["stages"][k]["core"])})
      free((state["stages"][k], state["inbox"][k]))  # shapes change: freed, not donated
    return {**state, "stages": stages, "inbox": [{} for _ in range(K)]}

  def unflatten(self, state, k: int):
    """Stage k's (packed state, inbox) in the other engines' layout (a copy)."""
    if self.replicas > 1:
      return self.gather_fn(k)(state["stages"][k]["flat"])
    return self.split_fn(k)(state["stages"][k]["flat"])

  def core(self, state, k: int) -> dict:
    """Stage k's core buffers (the `Layout` ones of the other engines), without the ring."""
    key = ("core", k)
    if key not in self.fns:
      flats, lengths, _ = self.layouts()
      R = self.replicas  # replica 0's copy
      self.fns[key] = jax.jit(lambda v: flats[k]["core"].unpack(
          part({n: a.reshape(R, -1)[0] for n, a in v.items()}, lengths)["core"]),
          out_shardings=self.placement.state_shardings[k])
    return self.fns[key](state["stages"][k]["flat"])


def join(kinds: dict, lengths: dict) -> dict:
  """{kind: {dtype: vector}} -> {dtype: the kinds' vectors one after another}."""
  names = sorted({n for kind in KINDS for n in lengths[kind]})
  return {n: jnp.concatenate([kinds[kind][n] for kind in KINDS if n in lengths[kind]])
          for n in names}


def part(vectors: dict, lengths: dict) -> dict:
  """The inverse of `join`."""
  out, offset = {kind: {} for kind in KINDS}, dict.fromkeys(vectors, 0)
  for kind in KINDS:
    for n, L in lengths[kind].items():
      out[kind][n] = vectors[n][offset[n]:offset[n] + L]
      offset[n] += L
  return out


def column(sharding) -> list:
  """The devices of a stage's state sharding, replica by replica."""
  if isinstance(sharding, NamedSharding):
    return list(sharding.mesh.devices.flat)
  return [next(iter(sharding.device_set))]


def free(tree) -> None:
  """Frees the device buffers of `tree` now (consumed inputs whose shapes change)."""
  for a in jax.tree.leaves(tree):
    a.delete()
