"""Splitting a model's block sequence into K stages: uniform, balanced, paper or explicit.

A split is given by its *boundaries*: K-1 strictly increasing block indices b_1 < ... < b_{K-1}
in (0, num_blocks); stage k runs blocks [b_k, b_{k+1}) (b_0 = 0, b_K = num_blocks).

    stages = partition.split(model, 4, "balanced", example_input=model.example_input(1))

Each stage is `Stage.from_linen` of a module whose blocks keep their global names (`block_i`),
so the variables of the stages are disjoint sub-dicts of the unsplit model's variables
(`split_tree` / `merge_trees` move them between splits).

Costs per block come from XLA's cost analysis ("flops", "bytes" accessed; see `block_costs`)
or from timing on the current device ("time"). They measure one training tick's work for the block:
its training forward plus its backward (vjp w.r.t. params and input), which is what a stage
does every tick under DDG and FDG. Stash memory per slot is the byte size of the vjp residuals
of the stage's training forward, the entry the schedules keep per delayed batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax.models import BlockRange, Model
from fdg_jax import plans
# The boundary helpers are partition's API too; they live apart so that fdg_jax.stages,
# which this module imports, can use them without importing it back.
from fdg_jax.boundaries import (check_boundaries, check_num_stages, stage_ranges,
                                uniform_boundaries)
from fdg_jax.delays import ring_heads_default, slots_held
from fdg_jax.stages import Residuals, Stage, training_vjp

PyTree = Any
SPLITS = ("uniform", "balanced", "paper")
COSTS = ("flops", "bytes", "time")

# Measurements per (kind, block config, input shape/dtype): CIFAR ResNets repeat a handful of
# block configurations many times (ResNet-1202: 602 blocks, 7 distinct), so this makes balancing
# cost a few compilations instead of hundreds.
_CACHE: dict = {}


# ----------------------------------------------------------------------------- boundaries
def ring_length(stage: int, num_stages: int, schedule: str,
                heads: bool | None = None) -> int:
  """Stash slots of stage `stage` as the schedules allocate them (`delays.slots_held`).

  The ring (`fdg_jax.ring_size`), and its head where the schedules keep one. FDG: a ring of
  2(K-1-k). DDG: K-k, one more than the K-1-k entries held between ticks, because a DDG
  stage stashes its forward of the new batch before its backward frees the oldest slot.
  With `heads` (default: the schedules' default on JAX's default backend,
  `delays.ring_heads_default`: not on CPU), a ring of two slots or more keeps a head
  besides, a copy of the slot the next tick reads, one slot more.
  """
  if schedule not in plans.names(microbatched=False, delayed=True):
    raise ValueError(f"unknown schedule {schedule!r}; expected one of "
                     f"{', '.join(plans.names(microbatched=False, delayed=True))}")
  if heads is None:
    heads = ring_heads_default(jax.default_backend())
  return slots_held(schedule, stage, num_stages, heads)


def parse_split(text):
  """A split given as text: "uniform" | "balanced" | "paper", or boundaries like "3,6,9".

  Non-strings (an explicit list) pass through. Raises ValueError on anything else.
  """
  if not isinstance(text, str) or text in SPLITS:
    return text
  try:
    return [int(t) for t in text.split(",")]
  except ValueError:
    raise ValueError(f"split must be one of {', '.join(SPLITS)} or comma-separated block "
                     f"indices such as 3,6,9; got {text!r}") from None


def balance(costs: Sequence[float], num_stages: int, *, memory: Sequence[float] | None = None,
            memory_weight: float = 0.0, schedule: str | None = None) -> list[int]:
  """Boundaries minimising the most expensive stage over all contiguous partitions (exact DP).

  Args:
    costs: per-block compute cost (any unit).
    num_stages: K.
    memory: per-block stash bytes per slot; needed when memory_weight > 0.
    memory_weight: w in [0, 1]. Stage k's cost is
      (1 - w) * C_k / sum(C) + w * ring_k * M_k / (ring_0 * sum(M)),
      with ring_k the stash slots stage k holds under `schedule` (`ring_length`: FDG
      2(K-1-k), DDG K-k). w = 0 balances compute, w = 1 minimises the largest stash.
    schedule: the delayed schedule whose stash is weighed (a registered name); needed when
      memory_weight > 0, unused otherwise.

  Returns:
    K-1 boundaries.
  """
  c = np.asarray(costs, dtype=np.float64)
  n, K = len(c), num_stages
  check_num_stages(K, n)
  if not 0.0 <= memory_weight <= 1.0:
    raise ValueError(f"memory_weight must be in [0, 1], got {memory_weight}")
  if memory_weight > 0 and memory is None:
    raise ValueError("memory_weight > 0 needs the per-block stash bytes (memory=...)")
  if memory_weight > 0 and schedule is None:
    raise ValueError("memory_weight > 0 weighs each stage's stash, whose length depends on the "
                     "schedule: pass schedule= (e.g. the one you will train)")
  C = np.concatenate([[0.0], np.cumsum(c)])
  M = np.concatenate([[0.0], np.cumsum(np.asarray(memory, np.float64))]) if memory is not None \
      else np.zeros(n + 1)
  rings = (np.array([ring_length(k, K, schedule) for k in range(K)], np.float64)
           if memory_weight > 0 else np.ones(K))
  c_norm = C[-1] if C[-1] > 0 else 1.0
  m_norm = rings[0] * M[-1] if rings[0] * M[-1] > 0 else 1.0

  def stage_cost(k, i, j):  # stage k = blocks [i, j); i may be an array
    return ((1.0 - memory_weight) * (C[j] - C[i]) / c_norm
            + memory_weight * rings[k] * (M[j] - M[i]) / m_norm)

  # best[k, j]: smallest achievable max-stage cost when stages 0..k cover blocks [0, j).
  best = np.full((K, n + 1), np.inf)
  prev = np.zeros((K, n + 1), dtype=np.int64)
  best[0, 1:] = stage_cost(0, 0, np.arange(1, n + 1))
  for k in range(1, K):
    for j in range(k + 1, n + 1):
      i = np.arange(k, j)
      v = np.maximum(best[k - 1, i], stage_cost(k, i, j))
      t = int(np.argmin(v))
      best[k, j], prev[k, j] = v[t], i[t]
  bounds, j = [], n
  for k in range(K - 1, 0, -1):
    j = int(prev[k, j])
    bounds.append(j)
  return bounds[::-1]


def boundaries(model: Model, num_stages: int, how="uniform", *, example_input=None,
               cost: str = "flops", memory_weight: float = 0.0,
               schedule: str | None = None) -> list[int]:
  """The K-1 boundaries of a split of `model` into `num_stages` stages.

  Args:
    how: "uniform" (equal block counts), "balanced" (minimise the most expensive stage, see
      `balance`), "paper" (the FDG reference code's split, `model.paper_splits`), or an explicit
      list of K-1 boundaries.
    example_input: array or ShapeDtypeStruct of one input batch (costs scale with it); defaults
      to `model.example_input(1)`. Used by "balanced" only.
    cost: "flops" | "bytes" | "time" (see the module docstring).
    memory_weight: blend of the normalised stash memory of `schedule` into the balanced cost.
    schedule: the schedule to be trained, whose stash `memory_weight` weighs (see `balance`).

  Raises:
    ValueError: bad num_stages, bad boundaries, unknown `how`/`cost`, or no paper split.
  """
  n = model.num_blocks
  if not isinstance(how, str):
    return check_boundaries(how, num_stages, n)
  check_num_stages(num_stages, n)
  if how == "uniform":
    return uniform_boundaries(n, num_stages)
  if how == "paper":
    if num_stages == 1:
      return []
    if num_stages not in model.paper_splits:
      known = sorted(model.paper_splits)
      raise ValueError(f"no paper split of {model.name} into {num_stages} stages"
                       + (f"; available: K = {', '.join(map(str, known))}" if known
                          else " (the reference code has none for this model)"))
    return check_boundaries(model.paper_splits[num_stages], num_stages, n)
  if how == "balanced":
    x = model.example_input(1) if example_input is None else example_input
    costs = block_costs(model, x, cost)
    memory = block_stash_bytes(model, x) if memory_weight > 0 else None
    return balance(costs, num_stages, memory=memory, memory_weight=memory_weight,
                   schedule=schedule)
  raise ValueError(f"unknown split {how!r}; expected one of {', '.join(SPLITS)} or a list of "
                   f"{num_stages - 1} boundaries")


def stages_from_boundaries(model: Model, bounds: Sequence[int]) -> list[Stage]:
  """One `Stage.from_linen` per block range; stage names are "<model>[start:stop]"."""
  bounds = check_boundaries(bounds, len(bounds) + 1, model.num_blocks)
  return [Stage.from_linen(model.module(a, b), name=f"{model.name}[{a}:{b}]")
          for a, b in stage_ranges(bounds, model.num_blocks)]


def split(model: Model, num_stages: int, how="uniform", *, example_input=None,
          cost: str = "flops", memory_weight: float = 0.0,
          schedule: str | None = None) -> list[Stage]:
  """Splits `model` into `num_stages` stages (arguments as `boundaries`).

  Stage k's apply is `apply(params, model_state, x, *, train, rng=None) -> (y, model_state)`;
  applied in order the stages compute exactly the unsplit `model.module()`.
  """
  bounds = boundaries(model, num_stages, how, example_input=example_input, cost=cost,
                      memory_weight=memory_weight, schedule=schedule)
  return stages_from_boundaries(model, bounds)


# ----------------------------------------------------------------------------- variables
_BLOCK_KEY = "block_"


def _block_index(key) -> int | None:
  if isinstance(key, str) and key.startswith(_BLOCK_KEY) and key[len(_BLOCK_KEY):].isdigit():
    return int(key[len(_BLOCK_KEY):])
  return None


def split_tree(tree: dict, bounds: Sequence[int]) -> list[dict]:
  """Splits unsplit-model variables (params, or a model state such as {"batch_stats": ...})
  into per-stage dicts, by the global block index in their `block_i` keys.

  Collections a stage has no entries in are left out, as that stage's own init leaves them out.
  """
  K = len(bounds) + 1

  def go(node):
    out = [{} for _ in range(K)]
    for key, value in node.items():
      b = _block_index(key)
      if b is not None:
        out[bisect.bisect_right(bounds, b)][key] = value
      elif isinstance(value, dict):
        for k, sub in enumerate(go(value)):
          if sub:
            out[k][key] = sub
      else:
        raise ValueError(f"cannot assign variable {key!r} to a stage: not under a block_i key")
    return out

  return go(dict(tree))


def merge_trees(trees: Sequence[dict]) -> dict:
  """Inverse of `split_tree`: deep-merges per-stage variable dicts into one."""
  out: dict = {}
  for tree in trees:
    for key, value in tree.items():
      if isinstance(value, dict) and isinstance(out.get(key), dict):
        out[key] = merge_trees([out[key], value])
      else:
        out[key] = value
  return out


# ----------------------------------------------------------------------------- measurement
def _struct(x):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), x)


def _unmapped(block):
  """The block without a BatchNorm `axis_name`: costs are measured outside any mapped axis."""
  if getattr(block, "bn_axis_name", None) is not None:
    return block.clone(bn_axis_name=None)
  return block


def _measurement_stage(model: Model, start: int, stop: int) -> Stage:
  """Blocks [start, stop) as a stage, as `split` builds it but without BN axis names."""
  blocks = tuple(_unmapped(b) for b in model.blocks[start:stop])
  return Stage.from_linen(BlockRange(blocks=blocks, start=start),
                          name=f"{model.name}[{start}:{stop}]")


def _block_stage(block) -> Stage:
  """One block as a stage, named `block_0` whatever its index: measurements of equal blocks on
  equal inputs are interchangeable (and cached as such)."""
  return Stage.from_linen(BlockRange(blocks=(_unmapped(block),), start=0), name="block")


def _unwrap(tree: dict) -> dict:
  """One collection of a one-block stage's variables, without the `block_0` level."""
  return tree.get("block_0", {})


def _wrap(params, state):
  """Inverse of `_unwrap` for a one-block stage's (params, state)."""
  return ({"block_0": params} if params else {},
          {col: {"block_0": v} for col, v in state.items()})


def stage_structs(stage: Stage, x) -> tuple[PyTree, PyTree, jax.ShapeDtypeStruct]:
  """(params, model_state, output) of `stage` on input `x`, as ShapeDtypeStructs (no FLOPs)."""
  x = _struct(x)
  p, s = jax.eval_shape(lambda x: stage.init(jax.random.key(0), x), x)
  y, _ = jax.eval_shape(lambda p, s, x: stage.apply(p, s, x, train=False), p, s, x)
  return p, s, y


def residual_bytes(stage: Stage, x) -> int:
  """Bytes of one stash slot of `stage` on input batch `x` (its training vjp's residuals)."""
  p, s, _ = stage_structs(stage, x)
  leaves, _, _ = Residuals.trace(stage, p, s, _struct(x), jax.random.key(0))
  return int(sum(math.prod(a.shape) * a.dtype.itemsize for a in leaves))


def _tick_fn(stage):
  """One tick's work for a stage: training forward, then backward with a ones cotangent."""
  def tick(p, s, x, rng):
    y, vjp_fn, new_s = training_vjp(stage, p, s, x, rng)
    grads = vjp_fn(jax.tree.map(jnp.ones_like, y))
    return y, new_s, grads
  return tick


def _forward_fn(stage):
  return lambda p, s, x, rng: stage.apply(p, s, x, train=True, rng=rng)


def _cost_analysis(fn, p, s, x, compiled: bool) -> dict:
  lowered = jax.jit(fn).lower(p, s, x, jax.random.key(0))
  ca = None if compiled else lowered.cost_analysis()
  if not ca:  # compiled requested, or no pre-compilation analysis on this backend
    ca = lowered.compile().cost_analysis()
  if isinstance(ca, (list, tuple)):  # older jax: one dict per computation
    ca = ca[0] if ca else {}
  return dict(ca or {})


def _time_fn(fn, stage, x, repeats: int = 5) -> float:
  p, s = stage.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype))
  xs, rng = jnp.zeros(x.shape, x.dtype), jax.random.key(1)
  f = jax.jit(fn)
  jax.block_until_ready(f(p, s, xs, rng))  # compile and warm up
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(p, s, xs, rng))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class BlockInfo:
  """Shapes of one block on a given input, all ShapeDtypeStructs: its `params`, its `state`
  ({collection: variables}), and its `input`/`output`."""

  params: PyTree
  state: PyTree
  input: jax.ShapeDtypeStruct
  output: jax.ShapeDtypeStruct


def block_info(model: Model, example_input) -> list[BlockInfo]:
  """Per-block shapes, propagating `example_input` through the blocks (eval_shape only)."""
  x = _struct(example_input)
  out = []
  for i, block in enumerate(model.blocks):
    key = ("info", repr(block), x.shape, str(x.dtype))
    if key not in _CACHE:
      p, s, y = stage_structs(_block_stage(block), x)
      _CACHE[key] = (_unwrap(p), {col: _unwrap(v) for col, v in s.items()}, y)
    p, s, y = _CACHE[key]
    out.append(BlockInfo(p, s, x, y))
    x = y
  return out


def param_count(tree: PyTree) -> int:
  """Number of scalars in a pytree of arrays or ShapeDtypeStructs."""
  return int(sum(np.prod(a.shape, dtype=np.int64) for a in jax.tree.leaves(tree)))


def block_costs(model: Model, example_input, cost: str = "flops", *, backward: bool = True,
                compiled: bool | None = None) -> np.ndarray:
  """Per-block cost on the batch `example_input` (nothing is run unless cost="time").

  Args:
    cost: "flops" ('flops' of XLA's cost analysis), "bytes" ('bytes accessed'), or "time"
      (median seconds on the default device; runs the block).
    backward: True: one training tick (training forward + vjp); False: training forward only.
    compiled: analyse the compiled (optimised) computation rather than the lowered one. The
      default is False for "flops": the lowered HLO counts the arithmetic the model asks for,
      within ~2% of the compiled count on CPU, at a fiftieth of the time (no backend
      compilation); and True for "bytes", which only mean something after fusion.

  Returns:
    float array of length `model.num_blocks`.
  """
  if cost not in COSTS:
    raise ValueError(f"unknown cost {cost!r}; expected one of {', '.join(COSTS)}")
  compiled = (cost == "bytes") if compiled is None else compiled
  infos = block_info(model, example_input)
  out = np.zeros(model.num_blocks)
  for i, (block, info) in enumerate(zip(model.blocks, infos)):
    key = (cost, backward, compiled, repr(block), info.input.shape, str(info.input.dtype))
    if key not in _CACHE:
      stage = _block_stage(block)
      fn = _tick_fn(stage) if backward else _forward_fn(stage)
      if cost == "time":
        _CACHE[key] = _time_fn(fn, stage, info.input)
      else:
        ca = _cost_analysis(fn, *_wrap(info.params, info.state), info.input, compiled)
        _CACHE[key] = float(ca.get("flops" if cost == "flops" else "bytes accessed", 0.0))
    out[i] = _CACHE[key]
  return out


def block_stash_bytes(model: Model, example_input) -> np.ndarray:
  """Per-block stash bytes per slot (vjp residuals). A stage's is close to the sum over its
  blocks; `residual_bytes` on the stage gives it exactly."""
  infos = block_info(model, example_input)
  out = np.zeros(model.num_blocks)
  for i, (block, info) in enumerate(zip(model.blocks, infos)):
    key = ("residual", repr(block), info.input.shape, str(info.input.dtype))
    if key not in _CACHE:
      _CACHE[key] = residual_bytes(_block_stage(block), info.input)
    out[i] = _CACHE[key]
  return out


def slot_bytes(model: Model, bounds: Sequence[int], example_input) -> list[int]:
  """Bytes of one stash slot of each stage of the split `bounds`, on the batch `example_input`."""
  infos = block_info(model, example_input)
  return [residual_bytes(_measurement_stage(model, a, b), infos[a].input)
          for a, b in stage_ranges(bounds, model.num_blocks)]


def stash_bytes(model: Model, bounds: Sequence[int], example_input, schedule: str,
                heads: bool | None = None) -> list[int]:
  """Bytes of each stage's whole stash: `slot_bytes` x ring_length(k, K, schedule, heads)."""
  K = len(bounds) + 1
  slots = slot_bytes(model, bounds, example_input)
  return [s * ring_length(k, K, schedule, heads) for k, s in enumerate(slots)]
