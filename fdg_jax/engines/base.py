"""What every engine is: the interface the schedule facade calls, and what engines share.

An engine runs a schedule's ticks: where a stage's calls execute and how often a program is
entered. Three implement `Engine`: `fused` (every stage in one program on one device),
`per_stage` (a device per stage, or a (data, stage) mesh; each call jitted on its devices)
and `spmd` (the ticks as one program over the devices, each running its own stage). Each
says what it refuses (`Engine.refusal`, one line naming the reason) and implements
`adopt`, `step`, `run`, `core`, `packed_stage` and `stash_bytes`. Which engine "auto" means
is decided here, once (`choose`, `preferred`).

An engine reads only the public parts of the schedule it runs: `plan`, `placement`, `math`
(the per-stage pieces), `shapes` (the state's layout), `jit` (a program with the schedule's
compiler options), `gate`, `scan`, `ready` and `metrics_spec`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax import ring
from fdg_jax.stage_math import NO_UPDATE

CLASSES: dict[str, type] = {}  # every engine, by name: the one list (`register`)


def register(cls):
  """Adds an `Engine` subclass to the engines a schedule can run on, under `cls.name` (a
  class decorator: an engine is its module and this one line)."""
  if not (isinstance(cls, type) and issubclass(cls, Engine)) or not cls.name:
    raise ValueError(f"register takes an Engine subclass with a name, got {cls!r}")
  if cls.name == "auto" or CLASSES.get(cls.name, cls) is not cls:
    raise ValueError(f"an engine named {cls.name!r} exists already")
  CLASSES[cls.name] = cls
  return cls


def names() -> tuple[str, ...]:
  """The registered engines' names, in registration order."""
  return tuple(CLASSES)


def plan_refusal(name: str, plan) -> str | None:
  """Why engine `name` cannot run `plan` wherever it is placed (one line), or None."""
  return CLASSES[name].plan_refusal(plan)


def choose(requested: str, placement) -> str:
  """The engine a schedule runs on: `requested`, or for "auto" the fused engine where every
  stage lies on one device, else the per-stage one."""
  if requested != "auto":
    return requested
  return "fused" if placement.single_device is not None else "per_stage"  # the two defaults


def preferred(platform: str, num_devices: int, num_stages: int) -> str:
  """The engine "auto" places stages for, from the devices a process sees: stages apart on K
  accelerators ("per_stage"); on CPU, where forced devices share the host's cores (stages
  apart gain nothing, and one program per call costs far less host time), and with fewer
  devices than stages, every stage on one device ("fused")."""
  apart = platform != "cpu" and num_devices >= num_stages > 1
  return "per_stage" if apart else "fused"


class Engine:
  """The interface of an engine (see the module docstring). `schedule`: the facade whose
  public parts the engine reads."""

  name = ""
  flat_rings = True  # keeps each stash ring as one flat buffer where telemetry is off

  @classmethod
  def plan_refusal(cls, plan) -> str | None:
    """Why this engine cannot run `plan` on any placement (one line), or None: the one
    statement of what plans it runs (checked up front, e.g. by the trainer's config check)."""
    return None

  @classmethod
  def refusal(cls, plan, placement, *, telemetry: bool) -> str | None:
    """Why this engine cannot run `plan` on `placement` (one line), or None."""
    return cls.plan_refusal(plan)

  def __init__(self, schedule):
    self.schedule = schedule
    self.fns: dict = {}  # the engine's programs, built once each

  def adopt(self, state) -> dict:
    """A state just allocated in the common layout (`shapes.Shapes.allocate`) in this
    engine's own layout (consumed)."""
    return state

  def step(self, state, batch) -> tuple[dict, dict]:
    raise NotImplementedError

  def run(self, state, xs, ys, T: int, length: int) -> tuple[dict, dict]:
    raise NotImplementedError

  def packed_stage(self, state, k: int) -> dict:
    """Stage k's packed state ({"core": ..., "stash": ...}) in the common layout."""
    return state["stages"][k]

  def core(self, state, k: int):
    """Stage k's packed core buffers (an accumulating plan's: its unpacked state)."""
    return self.schedule.plan.kind.core(state["stages"][k])

  def stash_bytes(self, state, k: int) -> int:
    """Bytes of stage k's stash ring as held (its head included)."""
    return sum(a.size * a.dtype.itemsize
               for a in jax.tree.leaves(state["stages"][k].get("stash", {})))


class HeadsApart:
  """A jitted call of the fused or per-stage engine, `(packed, *args)`, that passes the
  heads of the stash rings apart (see `ring.without_heads`). `packed`: one stage's state
  (`one_stage`) or the list of every stage's."""

  def __init__(self, jitted, one_stage: bool):
    self.jitted, self.one_stage = jitted, one_stage

  def __call__(self, packed, *args):
    if self.one_stage:
      (packed,), heads = ring.without_heads([packed])
    else:
      packed, heads = ring.without_heads(packed)
    return self.jitted(packed, heads, *args)

  def _cache_size(self) -> int:
    return self.jitted._cache_size()


def loop_ticks(body, carry, n, length: int, spec: dict, updated_shape: tuple):
  """A device loop of n <= `length` ticks (n traced, so one program serves every call with
  up to `length` ticks): `body(i, carry) -> (carry, row)`, row holding `spec`'s metrics,
  "valid" and "updated"; returns (carry, the rows stacked, unset past n)."""
  outs = {name: jnp.zeros((length,) + a.shape, a.dtype) for name, a in spec.items()}
  outs["valid"] = jnp.zeros((length,), bool)
  outs["updated"] = jnp.full((length,) + updated_shape, NO_UPDATE, jnp.int32)

  def loop(i, both):
    carry, outs = both
    carry, row = body(i, carry)
    return carry, {name: outs[name].at[i].set(row[name]) for name in outs}

  return jax.lax.fori_loop(0, n, loop, (carry, outs))


def unstack(tree, num: int) -> list:
  """The first `num` entries along the leading axis: free for host arrays, one call for
  device arrays (indexing them one by one would be a dispatch per entry and leaf)."""
  if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(tree)):
    return [jax.tree.map(lambda a: a[i], tree) for i in range(num)]
  return _unstack_jit(tree, num)


@functools.partial(jax.jit, static_argnums=1)
def _unstack_jit(tree, num):
  return [jax.tree.map(lambda a: a[i], tree) for i in range(num)]


@functools.partial(jax.jit, static_argnames="axis")
def stack(tree_of_lists, axis=0):
  """`jnp.stack` of every list in the pytree, as one call (not one dispatch per entry)."""
  return jax.tree.map(lambda xs: jnp.stack(xs, axis), tree_of_lists,
                      is_leaf=lambda x: isinstance(x, list))


def ticks(t0: int, num_ticks: int, length: int) -> np.ndarray:
  """run's `tick` metric: t0 .. t0+num_ticks-1, then -1 up to `length`."""
  return np.where(np.arange(length) < num_ticks, t0 + np.arange(length), -1)
