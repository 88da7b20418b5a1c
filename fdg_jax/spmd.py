"""The SPMD engine: T ticks of FDG as one program over the stages' devices.

`Schedule(..., engine="spmd")`, one device per stage (or an (R, K) mesh, below): `run` is
one jitted program, `shard_map`ped over a ("stage",) mesh of the K devices. Every device
loops over the T ticks; at each it runs its own stage's work, chosen by `lax.switch` on its
stage index among the K stages' `_stage_work` / `_last_work` (the pure functions every
engine calls), then activations move up and cotangents down with one `lax.ppermute` each.
FDG only: its stages read only the messages of the previous tick, so a tick is one round of
local work and one exchange (BP and DDG chain stages within a tick). `step` is `run` with
T = 1.

Stages differ in shapes, while a switch's branches and a shard_map's blocks must agree, so
a stage's state is held as one flat vector per dtype, padded to the largest stage's size:
its core state (the `Layout` buffers of the other engines), its stash ring (D slots one
after another), its incoming activation and its incoming cotangent, one after another
(`_join`). The schedule state keeps these vectors between calls (`state["stages"][k]
["flat"]`), so a call assembles them into mesh arrays without copying and carries a few
buffers per stage whatever the model. The stash ring stays outside the switch (see
`ring.RingView`).

The batches reach stage 0's device only (the labels travel with the activations, as in the
other engines); the other devices hold cached zeros of their shape.

The devices may lie in several processes (`jax.distributed`): every process runs the same
program, its own devices' part of it; stage 0's feeding processes pass their rows of the
batches (`put_first`), the state's vectors are global arrays over each stage's column, and
the metrics come back replicated over the whole mesh so that every process holds them.

Data-parallel replicas (an (R, K) ("data", "stage") mesh, `mesh=`): the program is
`shard_map`ped over both axes, each device holding its replica's share of the batch (B/R
examples) and of the messages and stash, and its own copy of its stage's core state. The
stage work is the same function, traced with the schedule's replica axis set
(`Schedule._replica_mean`): gradients, BatchNorm statistics and the metrics are averaged
over the replicas with `pmean` (inside the switch: the devices of one stage column take the
same branch), and each replica draws its own dropout masks. Unlike the per-stage engine,
whose programs see the global batch (jit inserts the all-reduce, and BatchNorm normalises
over all B examples), a BatchNorm layer here normalises over its replica's B/R examples, as
data-parallel training without synchronised BatchNorm does; for models without such
batch-coupled layers and dropout the two engines agree to float rounding.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from fdg_jax.packing import Layout, pad as _pad
from fdg_jax.ring import RingView
from fdg_jax.placement import DATA_AXIS, _put_global

AXIS = "stage"
KINDS = ("core", "ring", "act", "cot")


def _layout(tree) -> Layout:
  """The `Layout` of `tree`, which must pack whole (every leaf in a dtype's buffer)."""
  layout = Layout.of(tree)
  if any(name.startswith("leaf") for name in layout.names):
    raise ValueError("engine='spmd' packs the state into flat buffers and cannot hold "
                     "typed PRNG keys; pass raw uint32 keys (jax.random.PRNGKey)")
  return layout


class Engine:
  """The SPMD `run` and `step` of one schedule (its programs built once its shapes are
  known, at the state's allocation)."""

  def __init__(self, schedule):
    self.schedule = schedule
    self.columns = [_column(s) for s in schedule.placement.state_shardings]
    self.devices = [c[0] for c in self.columns]  # replica 0's
    self.replicas = R = len(self.columns[0])
    if R == 1:
      self.mesh = Mesh(np.asarray(self.devices, dtype=object), (AXIS,))
      self._vector_spec, self._batch_spec = P(AXIS), P(AXIS)
      # One device each: a `SingleDeviceSharding`, or where the stages lie in several
      # processes the placement's one-device mesh (what multi-process arrays need).
      self._column_shardings = [
          s if isinstance(s, NamedSharding) else SingleDeviceSharding(d)
          for s, d in zip(schedule.placement.state_shardings, self.devices)]
    else:  # device (r, k): replica r's stage k
      grid = np.asarray(self.columns, dtype=object).T
      self.mesh = Mesh(grid, (DATA_AXIS, AXIS))
      self._vector_spec, self._batch_spec = P((DATA_AXIS, AXIS)), P(AXIS, DATA_AXIS)
      self._column_shardings = [NamedSharding(Mesh(np.asarray(c, dtype=object), (DATA_AXIS,)),
                                              P(DATA_AXIS)) for c in self.columns]
    self._multi = jax.process_count() > 1
    self._returned = None  # the last call's mesh arrays, while its state lives (_mesh_vectors)
    self._layouts = None
    self._local = None
    self._fns: dict = {}

  @staticmethod
  def check(schedule) -> None:
    """Raises a one-line ValueError where the SPMD engine cannot run `schedule`."""
    K, P_ = schedule.num_stages, schedule.placement
    if not schedule.plan.decoupled:
      raise ValueError(f"engine='spmd' runs plans whose calls read only the previous tick's "
                       f"messages (FDG); {schedule.algorithm} chains its stages within a tick: "
                       "use engine='per_stage'")
    if K < 2:
      raise ValueError("engine='spmd' needs at least 2 stages, one per device")
    devices = [d for s in P_.state_shardings for d in _column(s)]
    if len(set(devices)) != K * P_.num_replicas:
      raise ValueError("engine='spmd' needs K distinct devices (devices=jax.devices()[:K]), "
                       "or R x K distinct devices in a (data, stage) mesh; on one device "
                       "use engine='fused'")

  # ------------------------------------------------------------------ layouts
  def layouts(self):
    """(per stage and kind its `Layout`, per kind and dtype the padded length, per dtype the
    largest slot).

    A ring vector holds the largest stage's D_k slots, and room to write a slot of the
    largest size at any stage's last slot (the program writes that many elements).
    """
    if self._layouts is not None:
      return self._layouts
    s, K = self.schedule, self.schedule.num_stages
    entry_specs, act_specs, _ = self.local_specs()
    flats = []
    for k in range(K):
      core = _layout({name: jax.ShapeDtypeStruct((n,), name)
                      for name, n in _layout(s._core_spec(k)).sizes.items()})
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
        scale = s.ring_sizes[k] if kind == "ring" else 1
        for name, n in f[kind].sizes.items():
          lengths[kind][name] = max(lengths[kind].get(name, 0), scale * n)
          if kind == "ring":
            slots[name] = max(slots.get(name, 0), n)
    for name, n in slots.items():  # room to write the largest slot at any stage's last
      lengths["ring"][name] = max([lengths["ring"][name]] + [
          (s.ring_sizes[k] - 1) * f["ring"].sizes.get(name, 0) + n
          for k, f in enumerate(flats) if f["ring"] is not None])
    self._layouts = flats, lengths, slots
    return self._layouts

  def local_specs(self):
    """Per stage, what one device of the program holds: (stash entry specs, outgoing
    activation message specs, the stash's `stages.Residuals`). With one replica, the schedule's
    own; with R, those of a B/R batch (traced: the vjp's structure, e.g. the cotangent
    shapes it checks, follows the batch)."""
    s, K, R = self.schedule, self.schedule.num_stages, self.replicas
    if R == 1:
      return s._entry_specs, s._act_specs, s._stash_residuals
    if self._local is not None:
      return self._local
    x, y = s._batch_spec  # a multiple of R (`Schedule._prepare`)
    local = lambda a: jax.ShapeDtypeStruct((a.shape[0] // R,) + a.shape[1:], a.dtype)
    a, y = local(x), local(y)
    entries, acts, residuals = [None] * K, [None] * K, [None] * K
    for k in range(K - 1):  # no telemetry's extras: the engine takes no telemetry
      entries[k], residuals[k], a = s._entry_and_output(k, a)
      acts[k] = (a, y, jax.ShapeDtypeStruct((), jnp.int32))
    self._local = entries, acts, residuals
    return self._local

  def _tables(self) -> dict:
    """Per-stage constants the program indexes by its stage: ring size, where the `pops`
    and `pushes` counters sit in the int32 core vector, and the slot size per dtype."""
    s, K = self.schedule, self.schedule.num_stages
    flats, _, slots = self.layouts()
    table = {"ring_size": [], "pops_at": [], "pushes_at": []}
    table.update({"slot_" + name: [] for name in slots})
    for k in range(K):
      lay = s._core_layouts[k]
      index = lay.treedef.unflatten(range(len(lay.shapes)))  # leaf index of each entry
      table["ring_size"].append(s.ring_sizes[k] if k < K - 1 else 1)
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
  def _stack_fn(self, k: int):
    """Stage k's packed state and inbox -> its padded vectors (one per dtype), on its device."""
    key = ("stack", k)
    if key in self._fns:
      return self._fns[key]
    flats, lengths, _ = self.layouts()
    f, D = flats[k], self.schedule.ring_sizes[k]

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
      return _join(out, lengths)

    fn = jax.jit(stack, out_shardings=self._column_shardings[k])
    self._fns[key] = fn
    return fn

  def _start_fn(self, k: int):
    """With replicas: stage k's packed core -> its vectors on its column, each replica's
    block the core and zeros (the ring and inbox of a state just allocated)."""
    key = ("start", k)
    if key in self._fns:
      return self._fns[key]
    flats, lengths, _ = self.layouts()
    f, R = flats[k], self.replicas

    def start(core):
      out = {"core": f["core"].pack(core, lengths["core"])}
      for kind in ("ring", "act", "cot"):
        out[kind] = {n: jnp.zeros((L,), n) for n, L in lengths[kind].items()}
      return {n: jnp.tile(v, R) for n, v in _join(out, lengths).items()}

    fn = jax.jit(start, out_shardings=self._column_shardings[k])
    self._fns[key] = fn
    return fn

  def _gather_fn(self, k: int):
    """With replicas: the inverse of `_start_fn` for any state, as the other engines lay it
    out: the core of replica 0 (the replicas' cores are equal), and each batch-major leaf of
    the stash and inbox the replicas' parts joined along its batch axis (a leaf that is not
    batch-major, e.g. a BatchNorm layer's batch statistics, is replica 0's)."""
    key = ("gather", k)
    if key in self._fns:
      return self._fns[key]
    s, R = self.schedule, self.replicas
    flats, lengths, _ = self.layouts()
    f, D = flats[k], s.ring_sizes[k]

    def join(parts, axis):
      return parts[0] if axis is None else jnp.concatenate(parts, axis)

    def gather(vectors):
      rows = [_part({n: v.reshape(R, -1)[r] for n, v in vectors.items()}, lengths)
              for r in range(R)]
      packed = {"core": f["core"].unpack(rows[0]["core"])}
      if f["ring"] is not None:
        rings = [f["ring"].unpack_slots(row["ring"], D) for row in rows]
        packed["stash"] = {"ring": tuple(
            join(parts, None if ax is None else ax + 1)
            for parts, ax in zip(zip(*rings), s._stash_axes[k]))}
      box = {}
      for kind in ("act", "cot"):
        if f[kind] is not None:
          trees = [f[kind].unpack(row[kind]) for row in rows]
          box[kind] = jax.tree.map(lambda *parts: join(parts, 0 if parts[0].ndim else None),
                                   *trees)
      return packed, box

    fn = jax.jit(gather)
    self._fns[key] = fn
    return fn

  def _split_fn(self, k: int):
    """The inverse of `_stack_fn`: stage k's packed state and inbox, sharded as before."""
    key = ("split", k)
    if key in self._fns:
      return self._fns[key]
    s = self.schedule
    flats, lengths, _ = self.layouts()
    f, D = flats[k], s.ring_sizes[k]

    def split(vectors):
      v = _part(vectors, lengths)
      packed = {"core": f["core"].unpack(v["core"])}
      if f["ring"] is not None:  # slot after slot -> [D, ...] per leaf
        packed["stash"] = {"ring": tuple(f["ring"].unpack_slots(v["ring"], D))}
      box = {kind: f[kind].unpack(v[kind]) for kind in ("act", "cot") if f[kind] is not None}
      return packed, box

    P_ = s.placement
    box_shardings = {}
    if f["act"] is not None:
      box_shardings["act"] = P_.message_shardings(k, s._act_specs[k - 1])
    if f["cot"] is not None:
      box_shardings["cot"] = P_.message_shardings(k, s._act_specs[k][0])
    shardings = s._state_shardings(k)
    if "stash" in shardings:  # the ring alone: the SPMD program reads its slots itself
      shardings["stash"] = {"ring": shardings["stash"]["ring"]}
    fn = jax.jit(split, out_shardings=(shardings, box_shardings))
    self._fns[key] = fn
    return fn

  # ------------------------------------------------------------------ the program
  def _branch(self, k: int):
    """Stage k's tick on its padded vectors: the body of switch branch k.

    (core, slot read, act in, cot in, batch, t) -> (core, (entry written, flag),
    (act out, sent), (cot out, sent), batch updated, metrics, valid): everything but the
    core is a message or a slot, never the ring (see `ring.RingView`).
    """
    s, K = self.schedule, self.schedule.num_stages
    flats, lengths, slots = self.layouts()
    f = flats[k]

    def zeros(lens):
      return {n: jnp.zeros((L,), n) for n, L in lens.items()}

    def branch(core, segment, act_in, cot_in, batch, t):
      state = dict(s._core_layouts[k].unpack(f["core"].unpack(core)))
      if f["ring"] is not None:
        state["stash"] = RingView(segment, f["ring"])
      act = batch if k == 0 else f["act"].unpack(act_in)
      written = (zeros(slots), jnp.asarray(False))
      if k == K - 1:
        active = s._flags(k, t)[0]
        state, cot, metrics = s._last_work(state, act, active)
        act_out, act_sent, cot_sent = zeros(lengths["act"]), False, active
        updated = jnp.where(active, metrics["batch"], -1)
        valid = active
      else:
        do_fwd, do_bwd = s._flags(k, t)
        state, act, cot, updated = s._stage_work(k, state, act, f["cot"].unpack(cot_in),
                                                 do_fwd, do_bwd)
        act_out = flats[k + 1]["act"].pack(act, lengths["act"])
        act_sent, cot_sent = do_fwd, do_bwd
        metrics = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), s._metrics_spec())
        entry, flag = state.pop("stash").written
        entry = f["ring"].pack(entry)
        written = ({n: _pad(entry.get(n), L, n) for n, L in slots.items()}, jnp.asarray(flag))
        valid = False
      if k > 0:
        cot_out = flats[k - 1]["cot"].pack(cot, lengths["cot"])
      else:
        cot_out, cot_sent = zeros(lengths["cot"]), False
      core = f["core"].pack(s._core_layouts[k].pack(state), lengths["core"])
      return (core, written, (act_out, jnp.asarray(act_sent)), (cot_out, jnp.asarray(cot_sent)),
              jnp.asarray(updated, jnp.int32), metrics, jnp.asarray(valid))

    return branch

  def _program(self, length: int):
    """The jitted program: (vectors, xs, ys, t0, n) -> (vectors, metrics)."""
    key = ("run", length)
    if key in self._fns:
      return self._fns[key]
    s, K = self.schedule, self.schedule.num_stages
    branches = [self._branch(k) for k in range(K)]
    up = [(j, j + 1) for j in range(K - 1)]
    down = [(j + 1, j) for j in range(K - 1)]
    spec = s._metrics_spec()

    flats, lengths, slots = self.layouts()

    def per_device(vectors, xs, ys, t0, n):
      v = _part(vectors, lengths)  # xs, ys: real on stage 0's device only
      k = jax.lax.axis_index(AXIS)
      table = self._tables()
      D, pops_at, pushes_at = (jnp.asarray(table[name])[k]
                               for name in ("ring_size", "pops_at", "pushes_at"))
      size = {name: jnp.asarray(table["slot_" + name])[k] for name in slots}
      outs = {name: jnp.zeros((length,) + a.shape, a.dtype) for name, a in spec.items()}
      outs["valid"] = jnp.zeros((length,), bool)
      outs["updated"] = jnp.full((length,), -1, jnp.int32)

      def body(i, carry):
        v, outs = carry
        batch = (jax.tree.map(lambda a: a[i], xs), jax.tree.map(lambda a: a[i], ys))
        # The slot this tick reads and the one it writes, from the counters before the tick.
        counters = v["core"]["int32"]
        read_at, write_at = counters[pops_at] % D, counters[pushes_at] % D
        ring = v["ring"]
        segment = {name: jax.lax.dynamic_slice(ring[name], (read_at * size[name],), (L,))
                   for name, L in slots.items()}
        core, (entry, flag), act, cot, updated, metrics, valid = jax.lax.switch(
            k, branches, v["core"], segment, v["act"], v["cot"], batch, t0 + i)
        ring = dict(ring)
        for name, L in slots.items():
          at = (write_at * size[name],)
          old = jax.lax.dynamic_slice(ring[name], at, (L,))
          keep = flag & (jnp.arange(L) < size[name])  # a smaller slot: the rest stays
          ring[name] = jax.lax.dynamic_update_slice(ring[name], jnp.where(keep, entry[name], old),
                                                    at)
        act_in, act_sent = _collective(act, lambda a: jax.lax.ppermute(a, AXIS, up))
        cot_in, cot_sent = _collective(cot, lambda a: jax.lax.ppermute(a, AXIS, down))
        v = {"core": core, "ring": ring,
             "act": jax.tree.map(lambda a, b: jnp.where(act_sent, a, b), act_in, v["act"]),
             "cot": jax.tree.map(lambda a, b: jnp.where(cot_sent, a, b), cot_in, v["cot"])}
        row = {**metrics, "valid": valid, "updated": updated}
        outs = {name: outs[name].at[i].set(row[name]) for name in outs}
        return v, outs

      v, outs = jax.lax.fori_loop(0, n, body, (v, outs))
      # [K, L, ...] per name: the last stage's metrics, and every stage's `updated`.
      outs = _collective(outs, lambda a: jax.lax.all_gather(a, AXIS))
      updated = outs.pop("updated").T  # [L, K]
      outs = {name: a[K - 1] for name, a in outs.items()}
      outs["updated"] = updated
      return _join(v, lengths), outs

    vec, bat = self._vector_spec, self._batch_spec
    program = jax.shard_map(per_device, mesh=self.mesh, in_specs=(vec, bat, bat, P(), P()),
                            out_specs=(vec, P()),
                            # the stash's vjp structures are traced outside shard_map,
                            # without the axes in their types
                            check_vma=False)
    fn = s._jit(self._traced_per_replica(program), donate_argnums=0)
    self._fns[key] = fn
    return fn

  def _traced_per_replica(self, fn):
    """`fn` traced with the schedule's stage work set for one replica's share of the batch
    (its replica axis and vjp structures), and reset after, whatever happens."""
    if self.replicas == 1:
      return fn
    s = self.schedule

    def traced(*args):
      saved = s._data_axis, s._stash_residuals
      s._data_axis, s._stash_residuals = DATA_AXIS, list(self.local_specs()[2])
      try:
        return fn(*args)
      finally:
        s._data_axis, s._stash_residuals = saved

    return traced

  # ------------------------------------------------------------------ state
  def flatten(self, state):
    """A state in the per-stage layout of the other engines -> this engine's (consumed)."""
    K = self.schedule.num_stages
    stages = []
    for k in range(K):
      if self.replicas == 1:
        stages.append({"flat": self._stack_fn(k)(state["stages"][k], state["inbox"][k])})
      else:  # from an allocated state (zero stash and inbox), as `Schedule._allocate` gives
        stages.append({"flat": self._start_fn(k)(state["stages"][k]["core"])})
      _free((state["stages"][k], state["inbox"][k]))  # shapes change: freed, not donated
    return {**state, "stages": stages, "inbox": [{} for _ in range(K)]}

  def unflatten(self, state, k: int):
    """Stage k's (packed state, inbox) in the other engines' layout (a copy)."""
    if self.replicas > 1:
      return self._gather_fn(k)(state["stages"][k]["flat"])
    return self._split_fn(k)(state["stages"][k]["flat"])

  def core(self, state, k: int) -> dict:
    """Stage k's core buffers (the `Layout` ones of the other engines), without the ring."""
    key = ("core", k)
    if key not in self._fns:
      flats, lengths, _ = self.layouts()
      R = self.replicas  # replica 0's copy
      self._fns[key] = jax.jit(lambda v: flats[k]["core"].unpack(
          _part({n: a.reshape(R, -1)[0] for n, a in v.items()}, lengths)["core"]),
          out_shardings=self.schedule.placement.state_shardings[k])
    return self._fns[key](state["stages"][k]["flat"])

  # ------------------------------------------------------------------ run and step
  def put_first(self, tree, leading: bool = True):
    """Stage 0's batches as arrays on its devices: `tree`'s leaves [length, B, ...], or
    with `leading=False` one batch [B, ...], given a leading axis of 1.

    In a multi-process run a process holding stage 0's devices passes its rows of each
    batch (`Placement.local_batch_slice`), and the others arrays of the global shape
    (not read), as `Placement.put_batch` takes them."""
    sharding = self._batch_sharding(0)
    if not self._multi:
      return jax.device_put(tree, sharding) if leading else _leading(tree, sharding)
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [np.asarray(a) if leading else np.asarray(a)[None] for a in leaves]
    return treedef.unflatten(_put_global(leaves, [sharding] * len(leaves)))

  def run(self, state, first, T: int, length: int):
    """T ticks from `state` over the first T of `length` batches (`first`: `put_first`'s).

    Returns (state, metrics as `Schedule.run` documents them, but `tick`), the metrics on
    the last stage's device (replica 0's; over the whole mesh in a multi-process run, so
    that every process holds them)."""
    K = self.schedule.num_stages
    flat = self._mesh_vectors([s["flat"] for s in state["stages"]])
    batches = self._on_mesh([first] + [self._zeros_like(first, k) for k in range(1, K)],
                            self._batch_spec)
    flat, outs = self._program(length)(flat, *batches, np.int32(int(state["tick"])),
                                       np.int32(T))
    if not self._multi:
      last = self.devices[K - 1]
      outs = jax.tree.map(lambda a: a.addressable_data(self._index(a, last)), outs)
    columns = [{n: self._column(a, k) for n, a in flat.items()} for k in range(K)]
    self._remember(columns, flat)
    return {**state, "stages": [{"flat": c} for c in columns]}, outs

  def step(self, state, first):
    """One tick, as `run` with T = 1 (`first`: `put_first(batch, leading=False)`). Returns
    (state, metrics as `Schedule.step` gives them, but `tick`; every value where `run`
    leaves its metrics)."""
    s, K, t = self.schedule, self.schedule.num_stages, int(state["tick"])
    state, out = self.run(state, first, 1, 1)
    metrics, updated = _first_row(out)
    flags = [s._flags(k, t) for k in range(K)]
    updated = tuple(u if f[1] else None for u, f in zip(updated, flags))
    return state, {**(metrics if flags[K - 1][0] else {}), "updated": updated}

  def _batch_sharding(self, k: int):
    """Where [length, B, ...] batches lie on stage k's devices: its device, or its column
    of replicas, split along the batch axis (stage 0 reads them; the others hold zeros)."""
    if self.replicas == 1:
      return self._column_shardings[k]
    return NamedSharding(self._column_shardings[k].mesh, P(None, DATA_AXIS))

  def _mesh_vectors(self, columns: list):
    """The state's per-stage vectors (`columns`, stage order) as the program's mesh arrays.

    Where they are the very arrays the last call returned, its mesh arrays serve again (they
    hold the same buffers), which saves reassembling them: about 40 µs per stage and call
    on CPU. Otherwise (a state from `flatten`, a restored checkpoint, an older state) they
    are assembled by `_on_mesh`."""
    if self._returned is not None:
      refs, flat, _ = self._returned
      if len(refs) == len(columns) and all(
          r.keys() == c.keys() and all(r[n]() is c[n] for n in c)
          for r, c in zip(refs, columns)):
        return flat
    return self._on_mesh(columns, self._vector_spec)

  def _remember(self, columns: list, flat) -> None:
    """Keeps `flat` for `_mesh_vectors` while every array of `columns` lives: the engine
    holds only weak references to them, and lets `flat` go when one of them is freed, so
    that a state the caller drops is not kept alive here."""
    token = object()
    this = weakref.ref(self)

    def forget(_ref):
      engine = this()
      if engine is not None and engine._returned is not None and engine._returned[2] is token:
        engine._returned = None

    refs = [{n: weakref.ref(a, forget) for n, a in c.items()} for c in columns]
    self._returned = (refs, flat, token)

  def _on_mesh(self, parts: list, spec):
    """Per-stage pytrees of arrays (stage order), each on its stage's column, as arrays on
    the mesh: the stages' blocks along the axis `spec` names "stage", the replicas' along
    the one it names "data" (their shards as they lie)."""
    K, R, sharding = len(parts), self.replicas, NamedSharding(self.mesh, spec)
    axes = {name: i for i, names in enumerate(spec)
            for name in (names if isinstance(names, tuple) else (names,))}
    leaves = [jax.tree.leaves(p) for p in parts]
    out = []
    for a, column in zip(leaves[0], zip(*leaves)):
      shape = list(a.shape)
      shape[axes[AXIS]] *= K
      if R > 1 and axes[DATA_AXIS] != axes[AXIS]:  # the batch axis: whole on each stage
        shape[axes[DATA_AXIS]] = a.shape[axes[DATA_AXIS]]
      shards = [shard.data for b in column for shard in b.addressable_shards]
      out.append(jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards))
    return jax.tree.unflatten(jax.tree.structure(parts[0]), out)

  def _column(self, array, k: int):
    """Stage k's part of a mesh array of vectors, on its device or column."""
    if self.replicas == 1 and not self._multi:
      return array.addressable_data(self._index(array, self.devices[k]))
    mine = {shard.device for shard in array.addressable_shards}
    shards = [array.addressable_data(self._index(array, d)) for d in self.columns[k]
              if d in mine]  # none in a process that holds none of the column
    return jax.make_array_from_single_device_arrays(
        (array.shape[0] // len(self.columns),), self._column_shardings[k], shards,
        dtype=array.dtype)

  def _zeros_like(self, tree, k: int):
    """Cached zeros shaped like `tree`'s leaves on stage k's devices (the batches' place on
    the devices that do not read them), sharded like `tree`."""
    key = ("zeros", k, tuple((np.shape(a), jnp.dtype(a.dtype).name)
                             for a in jax.tree.leaves(tree)))
    if key not in self._fns:
      sharding = self._batch_sharding(k)
      zeros = lambda a: jax.make_array_from_callback(  # each process its own devices'
          np.shape(a), sharding, lambda index: np.zeros(np.shape(a), a.dtype)[index],
          dtype=a.dtype)
      self._fns[key] = jax.tree.map(zeros, tree)
    return self._fns[key]

  def _index(self, array, device) -> int:
    """Which of `array`'s addressable buffers lies on `device`."""
    key = ("index", array.sharding, device)
    if key not in self._fns:
      self._fns[key] = [s.device for s in array.addressable_shards].index(device)
    return self._fns[key]


def _leading(tree, sharding):
  """`tree` with a leading axis of 1 added, placed by `sharding`."""
  if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(tree)):
    return jax.device_put(jax.tree.map(lambda a: a[None], tree), sharding)
  if isinstance(sharding, NamedSharding):  # replicas: [B, ...] split as [1, B, ...] will be
    inner = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return _expander(sharding)(jax.device_put(tree, inner))
  return _expand(jax.device_put(tree, sharding))


@jax.jit
def _expand(tree):
  return jax.tree.map(lambda a: a[None], tree)


@functools.lru_cache(maxsize=None)
def _expander(sharding):
  return jax.jit(lambda tree: jax.tree.map(lambda a: a[None], tree), out_shardings=sharding)


@jax.jit
def _first_row(out):
  """`run`'s metrics of one tick: (the last stage's values, per-stage `updated` scalars)."""
  metrics = {n: a[0] for n, a in out.items() if n not in ("updated", "valid")}
  return metrics, tuple(out["updated"][0, k] for k in range(out["updated"].shape[1]))


def _collective(tree, fn):
  """`fn`, a collective over one array, applied to every leaf of `tree` in one call where
  the leaves allow: the 32-bit and bool leaves travel bit for bit in one uint32 vector (a
  call of a program over several devices pays for each collective: 25-30 µs on CPU),
  the others one call each. The axes `fn` puts in front of its result (all_gather's) are
  kept in front of every leaf."""
  leaves, treedef = jax.tree.flatten(tree)
  words = lambda a: a.dtype == jnp.bool_ or jnp.dtype(a.dtype).itemsize == 4
  packed = [i for i, a in enumerate(leaves) if words(a)]
  out = [None if i in packed else fn(a) for i, a in enumerate(leaves)]
  if packed:
    vector = jnp.concatenate([
        (leaves[i].astype(jnp.uint32) if leaves[i].dtype == jnp.bool_
         else jax.lax.bitcast_convert_type(leaves[i], jnp.uint32)).reshape(-1)
        for i in packed])
    rows = fn(vector)
    front, offset = rows.shape[:-1], 0
    for i in packed:
      a = leaves[i]
      block = rows[..., offset:offset + a.size].reshape(front + a.shape)
      offset += a.size
      out[i] = (block.astype(jnp.bool_) if a.dtype == jnp.bool_
                else jax.lax.bitcast_convert_type(block, a.dtype))
  return jax.tree.unflatten(treedef, out)


def _join(kinds: dict, lengths: dict) -> dict:
  """{kind: {dtype: vector}} -> {dtype: the kinds' vectors one after another}."""
  names = sorted({n for kind in KINDS for n in lengths[kind]})
  return {n: jnp.concatenate([kinds[kind][n] for kind in KINDS if n in lengths[kind]])
          for n in names}


def _part(vectors: dict, lengths: dict) -> dict:
  """The inverse of `_join`."""
  out, offset = {kind: {} for kind in KINDS}, dict.fromkeys(vectors, 0)
  for kind in KINDS:
    for n, L in lengths[kind].items():
      out[kind][n] = vectors[n][offset[n]:offset[n] + L]
      offset[n] += L
  return out


def _column(sharding) -> list:
  """The devices of a stage's state sharding, replica by replica."""
  if isinstance(sharding, NamedSharding):
    return list(sharding.mesh.devices.flat)
  return [next(iter(sharding.device_set))]


def _free(tree) -> None:
  """Frees the device buffers of `tree` now (consumed inputs whose shapes change)."""
  for a in jax.tree.leaves(tree):
    a.delete()
