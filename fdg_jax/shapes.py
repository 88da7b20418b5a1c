"""How a schedule's state is laid out: its stages' packed cores, stash rings and inbox.

A stage's state is its core (params, model_state, opt_state, rng, the pushes and pops
counters and, but for the last stage, stash_batch: which batch each slot holds) packed into
a few flat buffers per dtype (`packing.Layout`: a call's host cost grows with its leaves),
its stash ring (D_k slots of the stage's entry: one flat buffer per dtype, slot after slot,
or one [D_k, ...] buffer per leaf under a (data, stage) mesh, with telemetry and for
one-slot rings) and, where the plan reads messages of the previous tick, the inbox's
placeholders for them. `Shapes` knows these layouts once the batch's shapes are known
(`prepare`), allocates a state's buffers (`allocate`) and says where each lives
(`state_shardings`). A plan that accumulates (GPipe, 1F1B) carries only each stage's
params, model and optimizer states and key, unpacked.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax.packing import Layout
from fdg_jax.stages import Residuals, Stage


def check_message(k: int, spec) -> None:
  """Refuses, in one line, a message between stages with a non-floating leaf: its cotangent
  would be float0, which the stage after it cannot send back."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(spec)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise ValueError(
          f"stage {k} sends a {leaf.dtype} leaf ({jax.tree_util.keystr(path) or 'its output'})"
          f" to stage {k + 1}; messages between stages must be floating-point arrays: "
          "recompute integer data (positions, masks) inside each stage, or send it as floats")


def has_convolution(fn, *args) -> bool:
  """Whether `fn(*args)`, traced abstractly, contains a convolution (nested ones included)."""
  return "conv_general_dilated" in str(jax.make_jaxpr(fn)(*args))


def zeros(spec, sharding):
  """Zero arrays of the given ShapeDtypeStruct pytree, created directly on `sharding`.

  `sharding` is one sharding for every leaf or a pytree of them matching `spec`. In a
  multi-process run they are made by one jitted call: a host value put on devices of
  several processes costs a cross-process check per array.
  """
  if isinstance(sharding, jax.sharding.Sharding):
    sharding = jax.tree.map(lambda _: sharding, spec)
  if jax.process_count() > 1:
    make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec)
    return jax.jit(make, out_shardings=sharding)()
  return jax.tree.map(lambda s, sh: jnp.zeros(s.shape, s.dtype, device=sh), spec, sharding)


class Shapes:
  """The layouts of one schedule's state (see the module docstring). `flat_rings`: whether
  the rings may be kept flat (the fused and per-stage engines without telemetry; `prepare`
  keeps them per leaf under a mesh); `ring_heads`: whether a ring of two slots or more
  keeps its head (`ring.with_ring`)."""

  def __init__(self, plan, stages: Sequence[Stage], placement, *, backward: str,
               flat_rings: bool, ring_heads: bool):
    K = len(stages)
    self.plan, self.stages, self.placement = plan, list(stages), placement
    self.num_stages = K
    self.backward = backward
    self.flat_rings = flat_rings
    self.ring_heads = ring_heads
    self.core_layouts: list = [None] * K
    self.stash_axes: list = [None] * K
    self.stash_residuals: list = [None] * K  # `stages.Residuals`
    self.core_entry_sizes: list = [None] * K
    self.input_treedefs: list = [None] * K
    self.ring_layouts: list = [None] * K  # flat rings' slot layouts
    self.entry_specs: list = [None] * K
    self.act_specs: list = [None] * K
    self.act_shardings: list = [None] * K
    self.cot_shardings: list = [None] * K
    self.batch_spec = None
    self.has_conv = None

  @property
  def prepared(self) -> bool:
    return self.batch_spec is not None

  def has_head(self, k: int) -> bool:
    """Whether stage k's ring keeps its head (`ring_heads`, rings of two slots or more)."""
    return self.ring_heads and self.plan.ring_sizes[k] > 1

  def core_spec(self, k):
    """ShapeDtypeStructs of stage k's unpacked core state."""
    lay = self.core_layouts[k]
    return lay.treedef.unflatten([jax.ShapeDtypeStruct(s, d)
                                  for s, d in zip(lay.shapes, lay.dtypes)])

  # ------------------------------------------------------------------ tick 0
  def init_state(self, params, model_state, rng, optimizers) -> dict:
    """The state at tick 0: each stage's core packed (or, for a plan that accumulates,
    kept as it is) on its devices; the stash and inbox come with `allocate`."""
    K, P = self.num_stages, self.placement
    if not self.plan.kind.carries_stash:
      stages = [P.put_state(k, {
          "params": params[k], "model_state": model_state[k],
          "opt_state": optimizers[k].init(params[k]), "rng": jax.random.fold_in(rng, k)})
          for k in range(K)]
      return {"tick": np.asarray(0, np.int64), "stages": stages}
    stages = []
    for k in range(K):
      s = {
          "params": params[k],
          "model_state": model_state[k],
          "opt_state": optimizers[k].init(params[k]),
          "rng": jax.random.fold_in(rng, k),
          "pushes": jnp.zeros((), jnp.int32),
          "pops": jnp.zeros((), jnp.int32),
      }
      if k < K - 1:
        s["stash_batch"] = jnp.zeros((self.plan.ring_sizes[k],), jnp.int32)
      self.core_layouts[k] = layout = Layout.of(s)
      rep = P.state_shardings[k]
      pack = jax.jit(layout.pack, out_shardings={name: rep for name in layout.names})
      stages.append({"core": pack(P.put_state(k, s))})
    return {"tick": np.asarray(0, np.int64), "stages": stages, "inbox": None}

  # ------------------------------------------------------------------ the batch's shapes
  def prepare(self, batch, math) -> None:
    """Shapes, layouts and shardings of the stash entries and messages, for `batch`'s shapes.

    `batch` is the global batch (arrays or ShapeDtypeStructs). Under a mesh, a stash leaf is
    batch-major along the axis whose size follows the batch size (found by tracing the stage
    at the batch size and at twice it); such leaves are sharded along that axis. `math`: the
    schedule's `StageMath` (its forward and its telemetry's stash extras).
    """
    if any(lay is None for lay in self.core_layouts):
      raise ValueError("this schedule has no state layout yet: call schedule.init(...) first "
                       "(also before restoring a checkpointed state into it)")
    K, P = self.num_stages, self.placement
    spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), t)
    doubled = lambda t: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((2 * a.shape[0],) + a.shape[1:], a.dtype)
        if a.shape else a, t)
    x_spec, y_spec = spec(batch[0]), spec(batch[1])
    if x_spec.shape[0] % P.num_replicas:
      raise ValueError(f"a batch of {x_spec.shape[0]} does not split evenly over the "
                       f"{P.num_replicas} data-parallel replicas; use a multiple of "
                       f"{P.num_replicas}")
    self.batch_spec = (x_spec, y_spec)
    self.entry_specs = [None] * K
    self.core_entry_sizes = [None] * K
    self.input_treedefs = [None] * K  # each stage's input message structure (`recompute`)
    self.act_specs, self.act_shardings, self.cot_shardings = ([None] * K for _ in range(3))
    has_conv = False

    a_spec, a_spec2 = x_spec, doubled(x_spec)
    for k in range(K):
      self.cot_shardings[k] = P.message_shardings(k, a_spec)
      s = self.core_spec(k)
      has_conv = has_conv or has_convolution(
          lambda p, ms, a, st=self.stages[k]: st.apply(p, ms, a, train=True,
                                                       rng=jax.random.PRNGKey(0)),
          s["params"], s["model_state"], a_spec)
      if k == K - 1:
        break
      self.input_treedefs[k] = jax.tree.structure(a_spec)
      entry, self.stash_residuals[k], h_spec = self.entry_and_output(k, a_spec, math)
      check_message(k, h_spec)
      entry2, _, h_spec2 = self.entry_and_output(k, a_spec2, math)
      self.core_entry_sizes[k] = len(entry)
      entry = entry + math.telemetry_extras(k, s["params"], a_spec, y_spec)
      entry2 = entry2 + math.telemetry_extras(k, s["params"], a_spec2, y_spec)

      def batch_axis(e, e2):
        axis = next((i for i, (m, n) in enumerate(zip(e.shape, e2.shape)) if m != n), None)
        if axis is not None and e.shape[axis] % P.num_replicas:
          axis = None  # cannot be split evenly over the replicas: keep it replicated
        return axis

      self.stash_axes[k] = [batch_axis(e, e2) for e, e2 in zip(jax.tree.leaves(entry),
                                                               jax.tree.leaves(entry2))]
      self.entry_specs[k] = entry
      self.act_specs[k] = (h_spec, y_spec, jax.ShapeDtypeStruct((), jnp.int32))
      self.act_shardings[k] = P.message_shardings(k, self.act_specs[k])
      a_spec, a_spec2 = h_spec, h_spec2
    self.has_conv = has_conv
    self.ring_layouts = [None] * K
    if self.flat_rings and P.num_replicas == 1:
      # A one-slot ring (BP) stays per leaf: written whole, XLA forwards its entry to the
      # backward of the same program, where a packed one would be a copy of every residual.
      self.ring_layouts = [Layout.of(tuple(jax.tree.leaves(e)))
                           if e is not None and self.plan.ring_sizes[k] > 1 else None
                           for k, e in enumerate(self.entry_specs)]
      if any(lay is not None and any(n.startswith("leaf") for n in lay.names)
             for lay in self.ring_layouts):
        self.ring_layouts = [None] * K  # typed PRNG keys in an entry: rings per leaf

  def entry_and_output(self, k, a_spec, math):
    """Shapes of stage k's stash entry (without telemetry's extras), how the entry holds the
    vjp's residuals under `stash` (a `stages.Residuals`, else None) and the stage's output,
    for an input of shape `a_spec`."""
    s = self.core_spec(k)
    args = (s["params"], s["model_state"], a_spec, s["rng"])
    if self.backward == "stash":
      return Residuals.trace(self.stages[k], *args)
    h, _, _ = jax.eval_shape(lambda *z: math.vjp(k, *z), *args)
    return tuple(jax.tree.leaves(a_spec)), None, h

  # ------------------------------------------------------------------ buffers
  def stash_shardings(self, k: int):
    """Shardings of stage k's rings: activations split along their batch axis."""
    P = self.placement
    if self.ring_layouts[k] is not None:
      names = self.ring_layouts[k].names
      out = {part: {n: P.state_shardings[k] for n in names} for part in ("ring", "head")}
    else:
      axes = self.stash_axes[k]
      out = {"ring": tuple(P.buffer_sharding(k, None if ax is None else ax + 1)  # ring axis
                           for ax in axes),
             "head": tuple(P.buffer_sharding(k, ax) for ax in axes)}
    if not self.has_head(k):
      del out["head"]  # see `ring.with_ring`
    return out

  def state_shardings(self, k: int) -> dict:
    """The sharding of every buffer of stage k's packed state."""
    rep = self.placement.state_shardings[k]
    out = {"core": {name: rep for name in self.core_layouts[k].names}}
    if k < self.num_stages - 1:
      out["stash"] = self.stash_shardings(k)
    return out

  def allocate(self, state, batch, math) -> dict:
    """`state` with zero-filled stash and message buffers sized for `batch` (global, on
    stage 0), in the layout of the fused and per-stage engines."""
    K, P = self.num_stages, self.placement
    self.prepare(batch, math)
    stages, inbox = list(state["stages"]), [dict() for _ in range(K)]
    for k in range(K - 1):
      D = self.plan.ring_sizes[k]
      lay = self.ring_layouts[k]
      if lay is not None:  # flat: D slots one after another per dtype, and the head
        specs = {"ring": {n: jax.ShapeDtypeStruct((D * m,), n) for n, m in lay.sizes.items()},
                 "head": {n: jax.ShapeDtypeStruct((m,), n) for n, m in lay.sizes.items()}}
      else:  # one [D, ...] buffer per leaf, and the head
        entry = jax.tree.leaves(self.entry_specs[k])
        specs = {"ring": tuple(jax.ShapeDtypeStruct((D,) + e.shape, e.dtype) for e in entry),
                 "head": tuple(entry)}
      if not self.has_head(k):
        del specs["head"]
      stages[k] = {**stages[k], "stash": zeros(specs, self.stash_shardings(k))}
      # Placeholders for stage k's incoming cotangent and stage k+1's incoming activation,
      # where (and shaped as) the real messages will arrive.
      act_spec = self.act_specs[k]
      if self.plan.reads_inbox(k, "cot"):
        inbox[k]["cot"] = zeros(act_spec[0], P.message_shardings(k, act_spec[0]))
      if self.plan.reads_inbox(k + 1, "act"):
        inbox[k + 1]["act"] = zeros(act_spec, P.message_shardings(k + 1, act_spec))
    return {**state, "stages": stages, "inbox": inbox}
