"""The two kinds of tick, as strategies a plan selects once (`fdg_jax.plans.Plan.kind`).

- **Delayed** (`DELAYED`: BP, DDG, FDG, PipeDream): one batch enters a tick; each stage
  applies a gradient as soon as it has one, and what a later tick needs (the stash of
  `jax.vjp` residuals, the messages in flight) is carried in the state between ticks: each
  stage's core packed into flat buffers, a stash ring, an inbox.
- **Synchronous** (`SYNCHRONOUS`: GPipe, 1F1B): the tick's batch is split into M
  micro-batches, each stage sums their gradients and applies the sum at the tick's end; the
  stash lives within the tick, so the state between ticks is each stage's state as it is.

Everything that differs between the two, on the way from a schedule's options to a tick's
state and metrics, is a method here; the interpreter, the engines, the schedule facade, the
shapes and the dataflow check call the plan's kind instead of asking which it is. A new kind
of tick is one subclass of `TickKind` and one `register` line: a plan's kind is the first
registered kind that `selects` it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class TickKind:
  """What a kind of tick decides; `DELAYED` and `SYNCHRONOUS` are its two instances."""

  name = ""
  carries_stash = True  # whether the state holds stash rings and an inbox between ticks
  ready_at_init = True  # whether `Schedule.init` allocates the buffers for an example batch
  one_program_per_tick = False  # whether the fused engine runs T ticks as T programs always

  def __repr__(self) -> str:
    return f"tick_kinds.{self.name.upper()}"

  def selects(self, plan) -> bool:
    """Whether `plan`'s ticks are of this kind."""
    raise NotImplementedError

  # -- a schedule's options and inputs --------------------------------------------------
  def check_options(self, name, *, beta, backward, telemetry, shrink_at, mesh) -> None:
    """ValueError (one line) for an option this kind of tick cannot take."""

  def check_batch_size(self, plan, batch_size: int) -> None:
    """ValueError (one line) for a batch size this kind of tick cannot split."""

  def staleness_refusal(self, name: str) -> str | None:
    """Why the staleness telemetry cannot measure this kind of tick (None: it can)."""
    return None

  # -- the state ------------------------------------------------------------------------
  def view(self, layout, core):
    """A stage's state as a call sees it, from its core as the state holds it."""
    return layout.unpack(core)

  def core(self, stage_entry):
    """A stage's core buffers from its entry of the state's `stages`."""
    return stage_entry["core"]

  def unpack_stage(self, layout, packed: dict) -> dict:
    """A stage's entry of the state as a call sees it: core unpacked, stash as it is."""
    s = dict(self.view(layout, self.core(packed)))
    if "stash" in packed:
      s["stash"] = packed["stash"]
    return s

  def pack_stage(self, layout, s: dict) -> dict:
    """The inverse of `unpack_stage`."""
    s = dict(s)
    stash = s.pop("stash", None)
    out = {"core": layout.pack(s)}
    if stash is not None:
      out["stash"] = stash
    return out

  def ready(self, schedule, state, batch_spec):
    """`state` with its buffers allocated for `batch_spec` (and the schedule prepared)."""
    if state["inbox"] is None:
      schedule._flops = None  # pylint: disable=protected-access
      return schedule.engine_impl.adopt(schedule.shapes.allocate(state, batch_spec,
                                                                 schedule.math))
    if not schedule.shapes.prepared:  # a state restored into a fresh schedule
      schedule.shapes.prepare(batch_spec, schedule.math)
    return state

  def finish(self, stages, inbox, updated, metrics, t: int, num_stages: int):
    """The state after tick t and its metrics, from what the tick's program returned."""
    metrics = {**metrics, "tick": t, "updated": tuple(updated)}
    return {"tick": np.asarray(t + 1, np.int64), "stages": stages, "inbox": inbox}, metrics

  def metrics_spec(self, schedule, first):
    """The shapes of the last stage's metrics (`first`: a tick's metrics, where needed)."""
    if schedule._metrics_shapes is None:  # pylint: disable=protected-access
      K, shapes = schedule.num_stages, schedule.shapes
      act = shapes.batch_spec if K == 1 else shapes.act_specs[K - 2]
      schedule._metrics_shapes = jax.eval_shape(  # pylint: disable=protected-access
          lambda s, a: schedule.math.last_work(s, a, True)[2], shapes.core_spec(K - 1), act)
    return schedule._metrics_shapes  # pylint: disable=protected-access

  # -- inside a tick --------------------------------------------------------------------
  def tick_inputs(self, plan, math, ops, batch, t):
    """(tick index as the calls see it, the micro-batches' inputs by m, the labels where
    the last stage reads them): the whole batch for a delayed tick."""
    return None, None, None

  def input_of(self, firsts, batch, m: int):
    """The input of micro-batch m's first forward."""
    return batch

  def take_stash(self, entries: list, b):
    """The simulator's stash: removes and returns the entry a backward of batch b reads."""
    return entries.pop(0)  # a ring: first in, first out


class _Delayed(TickKind):
  name = "delayed"

  def selects(self, plan) -> bool:
    return True  # every plan not claimed by another kind


class _Synchronous(TickKind):
  name = "synchronous"
  carries_stash = False
  ready_at_init = False
  one_program_per_tick = True

  def selects(self, plan) -> bool:
    return plan.accumulates  # its stages apply a sum of micro-batch gradients

  def check_options(self, name, *, beta, backward, telemetry, shrink_at, mesh) -> None:
    bad = [n for n, value, off in (("beta", beta, 1.0), ("backward", backward, "stash"),
                                   ("telemetry", telemetry, False),
                                   ("shrink_at", shrink_at, "gradient")) if value != off]
    if bad:
      raise ValueError(f"{name} takes no {', '.join(bad)} (it has no delay: no stash policy, "
                       "shrinking or telemetry)")
    if mesh is not None:
      raise ValueError(f"{name} runs on one device or a device per stage; data-parallel "
                       "meshes are for plans that apply each gradient as it comes (bp, ddg, "
                       "fdg)")

  def check_batch_size(self, plan, batch_size: int) -> None:
    B, M = batch_size, plan.microbatches
    if B % M:
      raise ValueError(f"a batch of {B} does not split into microbatches={M} equal parts; "
                       f"use a batch size that {M} divides")

  def staleness_refusal(self, name: str) -> str | None:
    return f"{name} has no delay: there is no staleness to measure"

  def view(self, layout, core):
    return core

  def core(self, stage_entry):
    return stage_entry

  def pack_stage(self, layout, s: dict) -> dict:
    return s

  def ready(self, schedule, state, batch_spec):
    return state  # nothing to allocate: no stash or inbox between ticks

  def finish(self, stages, inbox, updated, metrics, t: int, num_stages: int):
    # every stage applies the tick's batch at the tick's end
    metrics = {**metrics, "batch": t, "tick": t, "updated": (t,) * num_stages}
    return {"tick": np.asarray(t + 1, np.int64), "stages": stages}, metrics

  def metrics_spec(self, schedule, first):
    return {n: jax.ShapeDtypeStruct(np.shape(v), jnp.asarray(v).dtype)
            for n, v in first.items() if n not in ("tick", "updated")}

  def tick_inputs(self, plan, math, ops, batch, t):
    tick = np.int32(t) if isinstance(t, int) else t
    firsts = {m: math.micro(batch[0], m) for m in range(plan.microbatches)}
    return tick, firsts, ops.move(plan.num_stages - 1, batch[1])

  def input_of(self, firsts, batch, m: int):
    return firsts.pop(m)

  def take_stash(self, entries: list, b):
    assert b in entries, (entries, b)  # within the tick, entries are found by micro-batch
    entries.remove(b)
    return b


DELAYED = _Delayed()
SYNCHRONOUS = _Synchronous()
KINDS: list = [SYNCHRONOUS, DELAYED]  # asked in order; DELAYED takes what is left
_GENERATION = 0


def register(kind: TickKind) -> TickKind:
  """Adds a kind of tick, asked before the built-in ones (`Plan.kind`) by every plan."""
  if not isinstance(kind, TickKind):
    raise TypeError(f"a tick kind is a fdg_jax.tick_kinds.TickKind, got {type(kind).__name__}")
  global _GENERATION
  KINDS.insert(0, kind)
  _GENERATION += 1  # every plan asks again
  return kind


def generation() -> int:
  """How many kinds were registered so far (a plan's cached kind is valid within one)."""
  return _GENERATION


def of(plan) -> TickKind:
  """The kind of `plan`'s ticks: the first of `KINDS` that selects it."""
  return next(k for k in KINDS if k.selects(plan))

