"""The stash ring: a stage's delayed-backward entries, D slots, and how the engines touch it.

A stage k < K-1 keeps its entries (the vjp residuals of its forwards, or their inputs
under `backward="recompute"`) in a ring of D_k slots (`Schedule.ring_sizes`, derived from
the plan): the next slot written is pushes % D_k, the one read pops % D_k. The ring is
packed, slot after slot, into one flat buffer per dtype (`packing.Layout`), or kept as one
[D, ...] buffer per leaf (under a (data, stage) mesh, with telemetry, for one-slot rings).

A stage's work never touches the ring itself: it sees a `RingView`, the entry of this
tick already read and a record of the entry it writes, and the engine reads and writes
the ring around the work (`with_ring`). Off CPU the state keeps next to the ring its head,
the entry the next tick reads, so that every read of the ring follows its update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from fdg_jax.packing import Layout


def select(flag, new, old):
  """`new` where `flag` else `old`, leaf by leaf; a Python bool selects without any op."""
  if flag is True:
    return new
  if flag is False:
    return old
  return jax.tree.map(lambda a, b: jnp.where(flag, a, b), new, old)


class RingView:
  """A stage's stash ring as `StageMath.stage_work` sees it: the entry this tick reads, already read
  (`head`), and the entry it writes, recorded for the engine to write after the work.

  XLA updates a buffer in place only where it can order every read of it before the write.
  A ring read at one slot and written at another, by values that do not depend on that
  read, is copied whole, twice per call or loop iteration, by XLA's default copy insertion.
  So no stage's work touches the ring itself: the engine reads the entry before the work
  and writes the new one after it (`with_ring`), where either XLA:CPU's
  region analysis proves the order or the entry comes from the ring's head, read after the
  previous tick's write; the SPMD engine slices it before its switch on the stage.

  `head` is the entry's leaves, or with `slot` (a `Layout`) its flat buffers.
  """

  def __init__(self, head, slot: Layout | None = None, written=None):
    self.head, self.slot, self.written = head, slot, written

  def read(self, index) -> tuple:
    """The entry of slot `index`, the one this tick reads (read by the engine already)."""
    del index
    return tuple(self.slot.unpack(self.head) if self.slot is not None else self.head)

  def write(self, index, entry, flag) -> "RingView":
    """Records `entry` (its leaves) and `flag` for the engine's write to slot `index`."""
    del index
    return RingView(self.head, self.slot, (tuple(jax.tree.leaves(entry)), flag))


def load(layout, ring, slot):
  """The entry at `slot` of a ring (its flat buffers under `layout`, or one buffer per leaf
  where `layout` is None)."""
  if layout is None:
    return tuple(buf[slot] for buf in ring)
  return {n: jax.lax.dynamic_slice(ring[n], (slot * m,), (m,)) for n, m in layout.sizes.items()}


def store(layout, ring, slot, entry, flag):
  """`ring` with `entry` (its leaves) written at `slot` where `flag`."""
  if layout is None:
    return tuple(buf.at[slot].set(select(flag, e, buf[slot])) for buf, e in zip(ring, entry))
  return layout.write(ring, entry, {n: slot * m for n, m in layout.sizes.items()}, where=flag)


def read_padded(ring: dict, slot, sizes: dict, lengths: dict) -> dict:
  """The SPMD engine's ring (per dtype one vector, slot after slot, each stage's slots of
  its own `sizes`): the `lengths` elements per dtype from `slot`'s start, padding included
  (every stage reads the largest stage's slot length)."""
  return {n: jax.lax.dynamic_slice(ring[n], (slot * sizes[n],), (L,))
          for n, L in lengths.items()}


def write_padded(ring: dict, slot, sizes: dict, lengths: dict, entry: dict, flag) -> dict:
  """`ring` with `entry` (per dtype `lengths` elements, padded) written at `slot` where
  `flag`: only the stage's own `sizes` elements, the rest of the window kept."""
  ring = dict(ring)
  for n, L in lengths.items():
    at = (slot * sizes[n],)
    old = jax.lax.dynamic_slice(ring[n], at, (L,))
    keep = flag & (jnp.arange(L) < sizes[n])  # a smaller slot: the rest stays
    ring[n] = jax.lax.dynamic_update_slice(ring[n], jnp.where(keep, entry[n], old), at)
  return ring


def with_ring(work: Callable, s: dict, act, cot, do_fwd, do_bwd, *, size: int, layout,
              head: bool, read: Optional[Callable] = None, write: Optional[Callable] = None):
  """`work(s, act, cot, do_fwd, do_bwd)` over a stage state whose stash is {"ring"} or
  {"ring", "head"}: the fused and per-stage engines' stage work. `read(ring, slot)` and
  `write(ring, slot, entry, flag)` default to `load` and `store` under `layout`.

  The work reads the entry at slot pops % D and records the entry it writes (`RingView`);
  the ring is written at slot pushes % D after the work. A read that the written entry
  does not depend on is not ordered before the write, and XLA answers with copies of the
  ring, twice per tick (XLA:CPU's default copy insertion, for per-leaf and flat rings
  alike). Two ways out: XLA:CPU's copy insertion with region analysis (the default
  `compiler_options` on CPU) proves the read done before the write and updates the ring
  in place; elsewhere the ring keeps its head (`head`), a copy of the slot the next tick
  reads, taken after the write, so that every read of the ring follows its update. The
  head's price: one more slot of memory per stage, and one slot copied per tick.
  """
  D = size
  read = read or (lambda ring, slot: load(layout, ring, slot))
  write = write or (lambda ring, slot, entry, flag: store(layout, ring, slot, entry, flag))
  ring = s["stash"]["ring"]
  # A one-slot ring keeps no head. Under BP a call either writes it or reads it (and where
  # both calls are in one program, XLA forwards the entry written whole); a call that does
  # both (PipeDream's stage K-2: its backward, then its forward) reads the slot before it
  # writes it, as every call does.
  entry = s["stash"]["head"] if head else read(ring, s["pops"] % D)
  write_at = s["pushes"] % D
  s = {**s, "stash": RingView(entry, layout)}
  s, act_out, cot_out, updated = work(s, act, cot, do_fwd, do_bwd)
  if s["stash"].written is not None:
    entry, flag = s["stash"].written
    ring = write(ring, write_at, entry, flag)
  s["stash"] = {"ring": ring}
  if head:
    s["stash"]["head"] = read(ring, s["pops"] % D)
  return s, act_out, cot_out, updated


def without_heads(stages: list) -> tuple[list, list]:
  """(stage states without the heads of their stash rings, the heads).

  A call takes the heads as an argument of their own, not donated: it writes the next
  head while its work still reads this one, and XLA would copy a donated head first.
  """
  rest, heads = [], []
  for s in stages:
    stash = s.get("stash")
    if stash is None or "head" not in stash:
      rest.append(s)
      heads.append(None)
    else:
      rest.append({**s, "stash": {"ring": stash["ring"]}})
      heads.append(stash["head"])
  return rest, heads


def with_heads(stages: list, heads: list) -> list:
  """The inverse of `without_heads`."""
  return [s if h is None else {**s, "stash": {"ring": s["stash"]["ring"], "head": h}}
          for s, h in zip(stages, heads)]
