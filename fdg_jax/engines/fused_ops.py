"""How the fused engine runs a stage's call inside its program: `FusedOps` masks the effects
of a stage gated by traced flags (`gate="mask"`), `GatedOps` runs it under a conditional
(`gate="cond"`), with the switch that it uses. Chosen per platform and model by
`Schedule.gate` (`fdg_jax.tuning.default_gate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fdg_jax import ring
from fdg_jax.ring import select
from fdg_jax.stage_math import NO_UPDATE


class FusedOps:
  """Each stage's work traced into the tick's program; messages stay put. Traced flags mask
  the work's effects (`gate="mask"`)."""

  old_messages_first = False  # see `interpreter.run_tick`: the order calls are issued in

  def __init__(self, math):
    self.math = math

  def begin_tick(self):
    pass

  def call(self, k, do_fwd, do_bwd):
    math = self.math
    if k == math.num_stages - 1:
      return lambda s, act, cot: math.call(k, s, act, None, do_fwd, do_bwd)

    def stage(s, act, cot):
      s, act_out, cot_out, updated = math.stage_with_ring(k, s, act, cot, do_fwd, do_bwd)
      return s, act_out, cot_out, updated, {}
    return stage

  def move(self, k, tree):
    return tree

  def move_all(self, messages):
    return [m for _, m in messages]

  # A plan that accumulates: the micro-batch actions traced into the tick's program.
  def forward_micro(self, k):
    return functools.partial(self.math.micro_forward, k)

  def last_micro(self):
    return self.math.micro_last

  def backward_micro(self, k):
    return functools.partial(self.math.micro_backward, k)

  def apply_sum(self, k):
    return functools.partial(self.math.apply_sum, k)


class GatedOps(FusedOps):
  """The fused engine gating by conditionals (`gate="cond"`).

  A stage whose flags are traced runs its work under `lax.switch` over the flag
  combinations it can meet (`StageMath.reachable_flags`), each branch the work traced with
  those flags as Python booleans: no masking selects, and no work in a branch that has none.
  Branches that send no message return zeros in its place (the tick keeps the old message
  where the flag is off).

  The stages' works are chained: each gated stage's first reads (its counters, the switch
  index) are made to depend on a token read off what the previous one wrote last (its ring,
  or its counters), a test that is always true but that XLA cannot fold. XLA:CPU then runs
  a tick's stages one after another instead of spreading their independent kernels over its
  thread pool, which on a small machine slows each of them more than it overlaps them. The
  stages issue in the order that reads each message of tick t-1 before the one replacing it
  is made (else XLA copies the new one).
  """

  old_messages_first = True

  def __init__(self, math):
    super().__init__(math)
    self._token = None  # always True, read off what the tick's previous gated stage wrote

  def begin_tick(self):
    self._token = None

  def _chained(self, value):
    """`value`, computed after the tick's previous gated stage."""
    if self._token is None:
      return value
    return jnp.where(self._token, value, jnp.zeros_like(value))

  def call(self, k, do_fwd, do_bwd):
    if isinstance(do_fwd, bool) and isinstance(do_bwd, bool):
      return super().call(k, do_fwd, do_bwd)
    if k == self.math.num_stages - 1:
      return self._last(do_fwd)
    math = self.math

    def call(s, act, cot):
      s = {**s, "pops": self._chained(s["pops"])}  # the ring's read follows the chain
      s, act_out, cot_out, updated = math.stage_with_ring(k, s, act, cot, do_fwd, do_bwd,
                                                          work=self._switched)
      last = jax.tree.leaves(s["stash"]["ring"]) + [s["pushes"]]
      self._token = functools.reduce(jnp.logical_and, map(always_true, last))
      return s, act_out, cot_out, updated, {}
    return call

  def _switched(self, k, s, act, cot, do_fwd, do_bwd):
    """`StageMath.stage_work` under a switch over stage k's flag combinations. The ring stays
    outside the conditional (`StageMath.stage_with_ring` reads the entry before it and
    writes the new one after it, masked by the forward's flag): a ring a branch updated
    would be copied whole into the conditional's result."""
    math, view = self.math, s["stash"]
    base = {name: v for name, v in s.items() if name != "stash"}
    traced = [not isinstance(f, bool) for f in (do_fwd, do_bwd)]
    combos = sorted({(f if traced[0] else do_fwd, b if traced[1] else do_bwd)
                     for f, b in math.reachable_flags(k)})

    def branch(f, b):
      def work(base, head, act, cot):
        s, act_out, cot_out, updated = math.stage_work(
            k, {**base, "stash": ring.RingView(head, view.slot)}, act if f else None,
            cot if b else None, f, b)
        written = s.pop("stash").written
        return s, act_out, cot_out, updated, None if written is None else written[0]
      return work

    branches = [branch(f, b) for f, b in combos]
    args = (base, view.head, act, cot)
    specs = [jax.eval_shape(fn, *args) for fn in branches]
    # (state, activation out, cotangent out, batch updated, entry written): what a branch
    # does not send or write is zeros, a branch that applies no gradient updated NO_UPDATE.
    fills = {i: next((sp[i] for sp in specs if sp[i] is not None), None) for i in (1, 2, 3, 4)}

    def uniform(fn):
      def g(*args):
        out = list(fn(*args))
        for i, spec in fills.items():
          if out[i] is None and spec is not None:
            value = NO_UPDATE if i == 3 else 0
            out[i] = jax.tree.map(lambda a: jnp.full(a.shape, value, a.dtype), spec)
        return tuple(out)
      return g

    if len(branches) == 1:
      out = uniform(branches[0])(*args)
    else:
      index = 0
      for i, (f, b) in enumerate(combos):
        match = jnp.logical_and(do_fwd == f if traced[0] else True,
                                do_bwd == b if traced[1] else True)
        index = jnp.where(match, i, index)
      # a message or written entry is used only where its flag is on
      used = [(True, f, b, True, f) for f, b in combos]
      out = switch(self._chained(index), [uniform(fn) for fn in branches], args, used)
    s, act_out, cot_out, updated, entry = out
    s["stash"] = ring.RingView(view.head, view.slot, None if entry is None else (entry, do_fwd))
    return s, act_out, cot_out, updated

  def _last(self, active):
    math = self.math

    def call(s, act, cot):
      del cot
      s = {**s, "pushes": self._chained(s["pushes"])}
      on = lambda s, act: math.last_work(s, act, True)
      _, cot_spec, metrics_spec = jax.eval_shape(on, s, act)
      zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
      off = lambda s, act: (s, zeros(cot_spec), zeros(metrics_spec))
      s, cot_out, metrics = switch(self._chained(jnp.asarray(active, jnp.int32)), [off, on],
                                   (s, act), [(True, False, False), (True, True, True)])
      self._token = always_true(s["pushes"])
      return s, None, cot_out, select(active, metrics["batch"], NO_UPDATE), metrics
    return call


def always_true(x):
  """A boolean scalar that is True whatever `x` holds, computed from x's first element by
  integer operations XLA does not fold: a dependency on `x` for what it selects."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: its bits
    x = jax.random.key_data(x)
  v = jnp.ravel(x)[0]
  if jnp.issubdtype(v.dtype, jnp.floating):
    v = jax.lax.bitcast_convert_type(v, jnp.dtype(f"int{8 * v.dtype.itemsize}"))
  elif not jnp.issubdtype(v.dtype, jnp.integer):
    v = v.astype(jnp.int32)
  return (v | 1) != 0


def switch(index, branches, args: tuple, used):
  """`lax.switch(index, branches, *args)`, without passing through the conditional what
  its branches merely pass on.

  XLA gives a conditional's results buffers of their own: it copies into them every operand
  a branch returns unchanged, and every value a branch returns twice (FDG's stash entry
  holds the weights the stage's state also returns). Every branch returns a tuple of parts
  of one structure; `used[i][part]` says whether branch i's part is used (a message is used
  only where its flag is on). An output leaf is left out of the conditional where every
  branch whose part is used returns the same operand, or the same value as an earlier
  output leaf; it is taken from there after the switch.
  """
  sources = []  # per branch, per output leaf: ("in", operand leaf) | ("out", leaf) | None

  def probe(fn):
    def run(*a):
      inputs = {id(x): j for j, x in enumerate(jax.tree.leaves(a))}
      out = fn(*a)
      seen, src = {}, []
      for p, x in enumerate(jax.tree.leaves(out)):
        src.append(("out", seen[id(x)]) if id(x) in seen else
                   ("in", inputs[id(x)]) if id(x) in inputs else None)
        seen.setdefault(id(x), p)
      sources.append(src)
      return out
    return run

  shapes = [jax.eval_shape(probe(fn), *args) for fn in branches]
  tree = jax.tree.structure(shapes[0])
  part_of = [i for i, part in enumerate(shapes[0]) for _ in jax.tree.leaves(part)]
  dropped = {}
  for p, part in enumerate(part_of):
    seen = {sources[i][p] for i in range(len(branches)) if used[i][part]}
    if len(seen) == 1 and None not in seen:
      dropped[p] = seen.pop()

  def lean(fn):
    return lambda *a: [x for p, x in enumerate(jax.tree.leaves(fn(*a))) if p not in dropped]

  kept = iter(jax.lax.switch(index, [lean(fn) for fn in branches], *args))
  inputs, full = jax.tree.leaves(args), []
  for p in range(len(part_of)):
    if p in dropped:
      kind, j = dropped[p]
      full.append(inputs[j] if kind == "in" else full[j])
    else:
      full.append(next(kept))
  return jax.tree.unflatten(tree, full)
