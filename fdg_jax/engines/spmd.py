"""The SPMD engine: T ticks of FDG as one program over the stages' devices.

`Schedule(..., engine="spmd")`, one device per stage (or an (R, K) mesh, below): `run` is
one jitted program, `shard_map`ped over a ("stage",) mesh of the K devices. Every device
loops over the T ticks; at each it runs its own stage's call, chosen by `lax.switch` on its
stage index among the K stages' `StageMath.call` (the pure functions every engine calls),
then activations move up and cotangents down with one `lax.ppermute` each.
FDG only: its stages read only the messages of the previous tick, so a tick is one round of
local work and one exchange (BP and DDG chain stages within a tick). `step` is `run` with
T = 1.

Stages differ in shapes, while a switch's branches and a shard_map's blocks must agree, so
a stage's state is held as one flat vector per dtype, padded to the largest stage's size
(`spmd_state.Vectors`). The schedule state keeps these vectors between calls
(`state["stages"][k]["flat"]`), so a call assembles them into mesh arrays without copying
and carries a few buffers per stage whatever the model. The stash ring stays outside the
switch (see `ring.RingView`): the program reads and writes its slots with
`ring.read_padded` and `ring.write_padded`.

The batches reach stage 0's device only (the labels travel with the activations, as in the
other engines); the other devices hold cached zeros of their shape.

The devices may lie in several processes (`jax.distributed`): every process runs the same
program, its own devices' part of it; stage 0's feeding processes pass their rows of the
batches (`put_first`), the state's vectors are global arrays over each stage's column, and
the metrics come back replicated over the whole mesh so that every process holds them.

Data-parallel replicas (an (R, K) ("data", "stage") mesh, `mesh=`): the program is
`shard_map`ped over both axes, each device holding its replica's share of the batch (B/R
examples) and of the messages and stash, and its own copy of its stage's core state. The
stage work is the same function, traced for one replica (`StageMath.per_replica`):
gradients, BatchNorm statistics and the metrics are averaged over the replicas with `pmean`
(inside the switch: the devices of one stage column take the same branch), and each
replica draws its own dropout masks. Unlike the per-stage engine,
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

from fdg_jax import ring
from fdg_jax.engines import base
from fdg_jax.engines.spmd_state import Vectors, column, join, part
from fdg_jax.packing import pad as _pad
from fdg_jax.placement import DATA_AXIS, _put_global
from fdg_jax.stage_math import NO_UPDATE

AXIS = "stage"


@base.register
class SpmdEngine(base.Engine):
  """The SPMD `run` and `step` of one schedule (its programs built once its shapes are
  known, at the state's allocation)."""

  name = "spmd"
  flat_rings = False

  @classmethod
  def plan_refusal(cls, plan) -> str | None:
    if not plan.decoupled:
      return (f"engine='spmd' runs plans whose calls read only the previous tick's messages "
              f"(FDG); {plan.name} chains its stages within a tick: use engine='per_stage'")
    return None

  @classmethod
  def refusal(cls, plan, placement, *, telemetry: bool) -> str | None:
    K = plan.num_stages
    why = cls.plan_refusal(plan)
    if why:
      return why
    if K < 2:
      return "engine='spmd' needs at least 2 stages, one per device"
    devices = [d for s in placement.state_shardings for d in column(s)]
    if len(set(devices)) != K * placement.num_replicas:
      return ("engine='spmd' needs K distinct devices (devices=jax.devices()[:K]), or R x K "
              "distinct devices in a (data, stage) mesh; on one device use engine='fused'")
    if telemetry:
      return ("staleness telemetry reads per-stage rings; use engine='per_stage' or 'fused' "
              "with telemetry=True")
    return None

  def __init__(self, schedule):
    super().__init__(schedule)
    columns = [column(s) for s in schedule.placement.state_shardings]
    self.devices = [c[0] for c in columns]  # replica 0's
    self.replicas = R = len(columns[0])
    if R == 1:
      self.mesh = Mesh(np.asarray(self.devices, dtype=object), (AXIS,))
      self._vector_spec, self._batch_spec = P(AXIS), P(AXIS)
      # One device each: a `SingleDeviceSharding`, or where the stages lie in several
      # processes the placement's one-device mesh (what multi-process arrays need).
      column_shardings = [
          s if isinstance(s, NamedSharding) else SingleDeviceSharding(d)
          for s, d in zip(schedule.placement.state_shardings, self.devices)]
    else:  # device (r, k): replica r's stage k
      grid = np.asarray(columns, dtype=object).T
      self.mesh = Mesh(grid, (DATA_AXIS, AXIS))
      self._vector_spec, self._batch_spec = P((DATA_AXIS, AXIS)), P(AXIS, DATA_AXIS)
      column_shardings = [NamedSharding(Mesh(np.asarray(c, dtype=object), (DATA_AXIS,)),
                                        P(DATA_AXIS)) for c in columns]
    self.vectors = Vectors(schedule, columns, column_shardings)
    self._multi = jax.process_count() > 1
    self._returned = None  # the last call's mesh arrays, while its state lives (_mesh_vectors)

  # ------------------------------------------------------------------ the state
  def adopt(self, state) -> dict:
    return self.vectors.flatten(state)

  def packed_stage(self, state, k: int) -> dict:
    return self.vectors.unflatten(state, k)[0]

  def core(self, state, k: int):
    return self.vectors.core(state, k)

  def stash_bytes(self, state, k: int) -> int:
    # every stage holds a ring padded to the largest
    return self.vectors.ring_bytes()

  # ------------------------------------------------------------------ the program
  def _branch(self, k: int):
    """Stage k's tick on its padded vectors: the body of switch branch k.

    (core, slot read, act in, cot in, batch, t) -> (core, (entry written, flag),
    (act out, sent), (cot out, sent), batch updated, metrics, valid): everything but the
    core is a message or a slot, never the ring (see `ring.RingView`).
    """
    s, K = self.schedule, self.schedule.num_stages
    math = s.math
    flats, lengths, slots = self.vectors.layouts()
    f = flats[k]

    def zeros(lens):
      return {n: jnp.zeros((L,), n) for n, L in lens.items()}

    def branch(core, segment, act_in, cot_in, batch, t):
      state = dict(s.shapes.core_layouts[k].unpack(f["core"].unpack(core)))
      if f["ring"] is not None:
        state["stash"] = ring.RingView(segment, f["ring"])
      act = batch if k == 0 else f["act"].unpack(act_in)
      cot = f["cot"].unpack(cot_in) if k < K - 1 else None
      do_fwd, do_bwd = math.flags(k, t)
      state, act, cot, updated, metrics = math.call(k, state, act, cot, do_fwd, do_bwd)
      written = (zeros(slots), jnp.asarray(False))
      if k < K - 1:
        act_out = flats[k + 1]["act"].pack(act, lengths["act"])
        entry, flag = state.pop("stash").written
        entry = f["ring"].pack(entry)
        written = ({n: _pad(entry.get(n), L, n) for n, L in slots.items()}, jnp.asarray(flag))
        metrics = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), s.metrics_spec())
      else:
        act_out = zeros(lengths["act"])
      if k > 0:
        cot_out = flats[k - 1]["cot"].pack(cot, lengths["cot"])
      else:
        cot_out = zeros(lengths["cot"])
      core = f["core"].pack(s.shapes.core_layouts[k].pack(state), lengths["core"])
      return (core, written,
              (act_out, jnp.asarray(do_fwd if k < K - 1 else False)),
              (cot_out, jnp.asarray(do_bwd if k > 0 else False)),
              jnp.asarray(NO_UPDATE if updated is None else updated, jnp.int32), metrics,
              jnp.asarray(do_fwd if k == K - 1 else False))

    return branch

  def program(self, length: int):
    """The jitted program: (vectors, xs, ys, t0, n) -> (vectors, metrics)."""
    key = ("run", length)
    if key in self.fns:
      return self.fns[key]
    s, K = self.schedule, self.schedule.num_stages
    branches = [self._branch(k) for k in range(K)]
    up = [(j, j + 1) for j in range(K - 1)]
    down = [(j + 1, j) for j in range(K - 1)]
    spec = s.metrics_spec()
    _, lengths, slots = self.vectors.layouts()

    def per_device(vectors, xs, ys, t0, n):
      v = part(vectors, lengths)  # xs, ys: real on stage 0's device only
      k = jax.lax.axis_index(AXIS)
      table = self.vectors.tables()
      D, pops_at, pushes_at = (jnp.asarray(table[name])[k]
                               for name in ("ring_size", "pops_at", "pushes_at"))
      size = {name: jnp.asarray(table["slot_" + name])[k] for name in slots}

      def body(i, v):
        batch = (jax.tree.map(lambda a: a[i], xs), jax.tree.map(lambda a: a[i], ys))
        # The slot this tick reads and the one it writes, from the counters before the tick.
        counters = v["core"]["int32"]
        read_at, write_at = counters[pops_at] % D, counters[pushes_at] % D
        segment = ring.read_padded(v["ring"], read_at, size, slots)
        core, (entry, flag), act, cot, updated, metrics, valid = jax.lax.switch(
            k, branches, v["core"], segment, v["act"], v["cot"], batch, t0 + i)
        stash = ring.write_padded(v["ring"], write_at, size, slots, entry, flag)
        act_in, act_sent = _collective(act, lambda a: jax.lax.ppermute(a, AXIS, up))
        cot_in, cot_sent = _collective(cot, lambda a: jax.lax.ppermute(a, AXIS, down))
        v = {"core": core, "ring": stash,
             "act": jax.tree.map(lambda a, b: jnp.where(act_sent, a, b), act_in, v["act"]),
             "cot": jax.tree.map(lambda a, b: jnp.where(cot_sent, a, b), cot_in, v["cot"])}
        return v, {**metrics, "valid": valid, "updated": updated}

      v, outs = base.loop_ticks(body, v, n, length, spec, ())
      # [K, L, ...] per name: the last stage's metrics, and every stage's `updated`.
      outs = _collective(outs, lambda a: jax.lax.all_gather(a, AXIS))
      updated = outs.pop("updated").T  # [L, K]
      outs = {name: a[K - 1] for name, a in outs.items()}
      outs["updated"] = updated
      return join(v, lengths), outs

    vec, bat = self._vector_spec, self._batch_spec
    program = jax.shard_map(per_device, mesh=self.mesh, in_specs=(vec, bat, bat, P(), P()),
                            out_specs=(vec, P()),
                            # the stash's vjp structures are traced outside shard_map,
                            # without the axes in their types
                            check_vma=False)
    fn = s.jit(self._traced_per_replica(program), donate_argnums=0)
    self.fns[key] = fn
    return fn

  def _traced_per_replica(self, fn):
    """`fn` traced with the schedule's stage work set for one replica's share of the batch
    (its replica axis and vjp structures)."""
    if self.replicas == 1:
      return fn
    math = self.schedule.math

    def traced(*args):
      with math.per_replica(DATA_AXIS, self.vectors.local_specs()[2]):
        return fn(*args)

    return traced

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

  def step(self, state, batch):
    s, t = self.schedule, int(state["tick"])
    first = self.put_first(tuple(batch), leading=False)  # global: [1, B, ...]
    state = s.ready(state, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                        first))
    state, metrics = self._step_placed(state, first)
    return {**state, "tick": np.asarray(t + 1, np.int64)}, {**metrics, "tick": t}

  def run(self, state, xs, ys, T, length):
    s, t0 = self.schedule, int(state["tick"])
    placed = self.put_first((xs, ys))  # global: in several processes, each its rows
    state = s.ready(state, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                        placed))
    state, out = self._run_placed(state, placed, T, length)
    out["tick"] = base.ticks(t0, T, length)
    return {**state, "tick": np.asarray(t0 + T, np.int64)}, out

  def _run_placed(self, state, first, T: int, length: int):
    """T ticks from `state` over the first T of `length` batches (`first`: `put_first`'s).

    Returns (state, metrics as `Schedule.run` documents them, but `tick`), the metrics on
    the last stage's device (replica 0's; over the whole mesh in a multi-process run, so
    that every process holds them)."""
    K = self.schedule.num_stages
    flat = self._mesh_vectors([s["flat"] for s in state["stages"]])
    batches = self._on_mesh([first] + [self._zeros_like(first, k) for k in range(1, K)],
                            self._batch_spec)
    flat, outs = self.program(length)(flat, *batches, np.int32(int(state["tick"])),
                                       np.int32(T))
    if not self._multi:
      last = self.devices[K - 1]
      outs = jax.tree.map(lambda a: a.addressable_data(self._index(a, last)), outs)
    columns = [{n: self._column(a, k) for n, a in flat.items()} for k in range(K)]
    self._remember(columns, flat)
    return {**state, "stages": [{"flat": c} for c in columns]}, outs

  def _step_placed(self, state, first):
    """One tick, as `_run_placed` with T = 1 (`first`: `put_first(batch, leading=False)`). Returns
    (state, metrics as `Schedule.step` gives them, but `tick`; every value where `run`
    leaves its metrics)."""
    s, K, t = self.schedule, self.schedule.num_stages, int(state["tick"])
    state, out = self._run_placed(state, first, 1, 1)
    metrics, updated = _first_row(out)
    flags = [s.plan.flags(k, t) for k in range(K)]
    updated = tuple(u if f[1] else None for u, f in zip(updated, flags))
    return state, {**(metrics if flags[K - 1][0] else {}), "updated": updated}

  def _batch_sharding(self, k: int):
    """Where [length, B, ...] batches lie on stage k's devices: its device, or its column
    of replicas, split along the batch axis (stage 0 reads them; the others hold zeros)."""
    if self.replicas == 1:
      return self.vectors.column_shardings[k]
    return NamedSharding(self.vectors.column_shardings[k].mesh, P(None, DATA_AXIS))

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
    shards = [array.addressable_data(self._index(array, d)) for d in self.vectors.columns[k]
              if d in mine]  # none in a process that holds none of the column
    return jax.make_array_from_single_device_arrays(
        (array.shape[0] // len(self.vectors.columns),), self.vectors.column_shardings[k], shards,
        dtype=array.dtype)

  def _zeros_like(self, tree, k: int):
    """Cached zeros shaped like `tree`'s leaves on stage k's devices (the batches' place on
    the devices that do not read them), sharded like `tree`."""
    key = ("zeros", k, tuple((np.shape(a), jnp.dtype(a.dtype).name)
                             for a in jax.tree.leaves(tree)))
    if key not in self.fns:
      sharding = self._batch_sharding(k)
      zeros = lambda a: jax.make_array_from_callback(  # each process its own devices'
          np.shape(a), sharding, lambda index: np.zeros(np.shape(a), a.dtype)[index],
          dtype=a.dtype)
      self.fns[key] = jax.tree.map(zeros, tree)
    return self.fns[key]

  def _index(self, array, device) -> int:
    """Which of `array`'s addressable buffers lies on `device`."""
    key = ("index", array.sharding, device)
    if key not in self.fns:
      self.fns[key] = [s.device for s in array.addressable_shards].index(device)
    return self.fns[key]


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


