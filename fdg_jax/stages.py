"""Stages: the pure functions a network is split into.

A stage k owns parameters theta_k and an optional model state (e.g. BatchNorm running
statistics). The schedules (BP, DDG, FDG) only ever see the two pure functions of a stage::

    init(rng, x) -> (params, model_state)
    apply(params, model_state, x, *, train, rng=None) -> (y, model_state)

`apply` returns the (possibly updated) model state; a stateless stage returns the one it was
given (by convention `{}`). `rng` is a PRNG key for stochastic layers such as dropout; stages
that need none ignore it.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax.boundaries import check_boundaries, stage_ranges, uniform_boundaries

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a split network: a pair of pure functions over pytrees.

  Attributes:
    apply: `apply(params, model_state, x, *, train, rng=None) -> (y, model_state)`.
    init: `init(rng, x) -> (params, model_state)`, or None when the caller supplies params.
    name: a label used in summaries and error messages.
  """

  apply: Callable[..., tuple[PyTree, PyTree]]
  init: Callable[[jax.Array, PyTree], tuple[PyTree, PyTree]] | None = None
  name: str = "stage"

  @classmethod
  def from_fn(cls, fn: Callable[[PyTree, PyTree], PyTree], init=None, name: str = "stage"):
    """Wraps a stateless `fn(params, x) -> y` as a stage (model state `{}`).

    `init`, if given, is `init(rng, x) -> params`.
    """

    def apply(params, model_state, x, *, train=True, rng=None):
      del train, rng
      return fn(params, x), model_state

    stage_init = None
    if init is not None:
      stage_init = lambda rng, x: (init(rng, x), {})
    return cls(apply=apply, init=stage_init, name=name)

  @classmethod
  def from_linen(cls, module, name: str | None = None):
    """Adapts a Flax Linen module to a stage.

    The module's collections other than `params` (e.g. `batch_stats`) become the model state
    and are updated by training forwards. If the module's `__call__` takes a `train` argument
    it is passed through (BatchNorm, dropout); a `dropout` RNG stream is fed from `rng`.
    """
    takes_train = "train" in inspect.signature(type(module).__call__).parameters

    def kwargs(train):
      return {"train": train} if takes_train else {}

    def init(rng, x):
      init_rng, drop_rng = jax.random.split(rng)
      variables = module.init({"params": init_rng, "dropout": drop_rng}, x, **kwargs(False))
      variables = dict(variables)
      params = variables.pop("params", {})
      return params, variables

    def apply(params, model_state, x, *, train=True, rng=None):
      variables = {"params": params, **model_state}
      rngs = {"dropout": rng} if rng is not None else {}
      if train and model_state:
        y, new_state = module.apply(
            variables, x, rngs=rngs, mutable=list(model_state.keys()), **kwargs(True))
        return y, dict(new_state)
      y = module.apply(variables, x, rngs=rngs, **kwargs(train))
      return y, model_state

    return cls(apply=apply, init=init, name=name or type(module).__name__)

  @classmethod
  def from_nnx(cls, module_or_modules, name: str | None = None, *, first_block: int = 0):
    """Adapts a Flax NNX module, or a list of them applied in order (blocks), to a stage.

    The module is `nnx.split` once, here; `apply` merges a fresh copy from the graph definition
    and the given pytrees on every call, so no call mutates the module passed in and `apply`
    is pure (safe under `jax.jit`, `jax.vjp`, `jax.grad` w.r.t. params and x).

    - params: the `nnx.Param` variables as a nested dict of arrays (`nnx.to_pure_dict`).
      A single module gives its own dict; a list gives `{"block_i": dict}` with i the block's
      global index `first_block + position` (blocks without parameters are left out), like
      the `block_i` names of the Linen stages of `fdg_jax.partition`.
    - model_state: every other variable (e.g. BatchNorm's `nnx.BatchStat`), in the same
      layout; `{}` if none. A training forward returns the updated one, an eval forward the
      one it was given. RNG streams (`nnx.RngState`) are in neither: their construction-time
      value is a constant of the stage. Sown `nnx.Intermediate` values are discarded.
    - train: the merged copy is put in `module.train()` / `module.eval()` mode (Dropout's
      `deterministic`, BatchNorm's `use_running_average`, ...).
    - rng: dropout keys come from it. A single module has all its RNG streams reseeded
      (`nnx.reseed`) with `rng`; in a list, block i's streams are reseeded with
      `jax.random.fold_in(rng, i)` (global i), so applying every stage of an `nnx_stages`
      split with the same `rng` draws exactly the masks of the unsplit block list. Same rng,
      same masks. With `rng=None` the streams keep their construction-time keys (the same
      masks on every call). Stochastic layers must hold their streams (`nnx.Dropout(...,
      rngs=rngs)`).
    - init(rng, x): NNX modules are initialised when constructed (they take `rngs` then), so
      `init` ignores `rng` and `x` and returns copies of the module's params and model state
      as they were when this stage was made. To re-initialise, construct the module again.

    Blocks of a list must not share variables. Plain callables (e.g. `jax.nn.relu`) may be
    list entries: they are applied as they are and own no variables.
    """
    from flax import nnx

    single = not isinstance(module_or_modules, (list, tuple))
    modules = [module_or_modules] if single else list(module_or_modules)
    if single and not isinstance(module_or_modules, nnx.Module):
      raise TypeError(f"from_nnx needs an nnx.Module or a list of them, got "
                      f"{type(module_or_modules).__name__}")
    filters = (nnx.Param, nnx.RngState, nnx.Intermediate, ...)

    blocks = []  # (key, graphdef | callable, rng_state, intermediates, tags, params, state)
    for j, m in enumerate(modules):
      key = None if single else f"block_{first_block + j}"
      if not isinstance(m, nnx.Module):
        if not callable(m):
          raise TypeError(f"block {first_block + j} is neither an nnx.Module nor callable: "
                          f"{type(m).__name__}")
        blocks.append((key, m, None, None, (), {}, {}))
        continue
      graphdef, params, rngs, inter, rest = nnx.split(m, *filters)
      tags = sorted({v.tag for _, v in nnx.to_flat_state(rngs)
                     if isinstance(v, nnx.RngKey)})
      # Pure dicts, so that every merge builds fresh Variables (merging a State reuses its
      # Variable objects, and reseeding would then mutate this stage's constants).
      blocks.append((key, graphdef, nnx.to_pure_dict(rngs), nnx.to_pure_dict(inter),
                     tuple(tags), nnx.to_pure_dict(params), nnx.to_pure_dict(rest)))

    def gather(i):
      if single:
        return blocks[0][i]
      return {b[0]: b[i] for b in blocks if jax.tree.leaves(b[i])}

    def init(rng, x):
      del rng, x
      copy = lambda t: jax.tree.map(lambda a: jax.numpy.array(a, copy=True), t)
      return copy(gather(5)), copy(gather(6))

    def apply(params, model_state, x, *, train=True, rng=None):
      new_state = {}
      for j, (key, graphdef, rngs, inter, tags, _, _) in enumerate(blocks):
        if rngs is None:  # a plain callable
          x = graphdef(x)
          continue
        p = params if single else params.get(key, {})
        ms = model_state if single else model_state.get(key, {})
        block = nnx.merge(graphdef, p, rngs, inter, ms)
        if train:
          block.train()
        else:
          block.eval()
        if rng is not None and tags:
          block_rng = rng if single else jax.random.fold_in(rng, first_block + j)
          nnx.reseed(block, **{t: block_rng for t in tags})
        x = block(x)
        if train:
          rest = nnx.to_pure_dict(nnx.split(block, *filters)[-1])
          if single:
            new_state = rest
          elif jax.tree.leaves(rest):
            new_state[key] = rest
      return x, (new_state if train else model_state)

    if name is None:
      if single:
        name = type(module_or_modules).__name__
      else:
        name = f"nnx[{first_block}:{first_block + len(modules)}]"
    return cls(apply=apply, init=init, name=name)


def nnx_stages(blocks: Sequence[Any], boundaries, *, name: str = "nnx") -> list[Stage]:
  """Splits a list of NNX blocks (applied in order) into K stages of contiguous blocks.

  `boundaries` is either K-1 strictly increasing block indices (stage k runs blocks
  [b_k, b_{k+1}), as in `fdg_jax.partition`) or an int K
  (`fdg_jax.boundaries.uniform_boundaries`).
  Stage k is `Stage.from_nnx(blocks[a:b], first_block=a)`, named "<name>[a:b]": its params
  are `{"block_i": ...}` with global block indices, and block i's dropout key is
  `fold_in(stage_rng, i)` (see `Stage.from_nnx`).
  """
  blocks = list(blocks)
  if isinstance(boundaries, numbers.Integral):
    boundaries = uniform_boundaries(len(blocks), boundaries)
  bounds = check_boundaries(boundaries, len(boundaries) + 1, len(blocks))
  return [Stage.from_nnx(blocks[a:b], name=f"{name}[{a}:{b}]", first_block=a)
          for a, b in stage_ranges(bounds, len(blocks))]


def training_vjp(stage: Stage, params, model_state, x, rng):
  """`jax.vjp` of `stage`'s training forward w.r.t. (params, x, (model_state, rng)).

  Returns (y, vjp_fn, new_model_state). Its residuals (the leaves of `vjp_fn`) are what a
  delayed-gradient stash keeps per slot; the model state and RNG are primal inputs rather than
  closed-over values so that the residuals are the vjp's only leaves.
  """

  def f(p, a, extra):
    ms, r = extra
    return stage.apply(p, ms, a, train=True, rng=r)

  return jax.vjp(f, params, x, (model_state, rng), has_aux=True)


@dataclasses.dataclass(frozen=True)
class Residuals:
  """How a stash slot holds a stage's vjp residuals (the leaves of `training_vjp`'s vjp_fn).

  Some residuals are constants that the vjp closes over rather than values of the forward:
  `jax.nn.relu`'s vjp, for one, keeps an all-zeros array of its activation's shape (the
  "else" branch of its select). A slot stores the others only, and the backward rebuilds
  the constants (`fills`) as broadcasts that XLA fuses into their uses: no memory per slot
  and no copy per tick for them.

  Attributes:
    treedef: the vjp_fn's pytree structure.
    fills: (leaf index, shape, dtype, scalar value) of each constant leaf.
  """

  treedef: Any
  fills: tuple = ()

  @classmethod
  def trace(cls, stage: Stage, params, model_state, x, rng) -> tuple[tuple, "Residuals", Any]:
    """(shapes of the leaves a slot stores, the structure, the shape of the stage's
    output), for these shapes (abstract values are fine), from one trace of the vjp."""
    fn = lambda *a: training_vjp(stage, *a)[:2]
    closed, (y, vjp_spec) = jax.make_jaxpr(fn, return_shape=True)(params, model_state, x, rng)
    leaves = jax.tree.leaves(vjp_spec)
    values = _fill_values(closed.jaxpr)[len(jax.tree.leaves(y)):]  # outputs: y's, then these
    fills = tuple((i, tuple(a.shape), a.dtype, value)
                  for i, (a, value) in enumerate(zip(leaves, values)) if value is not None)
    out = cls(jax.tree.structure(vjp_spec), fills)
    return out.stored(leaves), out, y

  def stored(self, leaves) -> tuple:
    """The leaves a slot stores, of all the vjp_fn's `leaves`."""
    skip = {i for i, *_ in self.fills}
    return tuple(a for i, a in enumerate(leaves) if i not in skip)

  def vjp_fn(self, stored) -> Callable:
    """The vjp_fn rebuilt from a slot's leaves (`stored`) and the constants."""
    leaves, rest = [], iter(stored)
    fills = {i: f for i, *f in self.fills}
    for i in range(self.treedef.num_leaves):
      if i in fills:
        shape, dtype, value = fills[i]
        leaves.append(jnp.full(shape, value, dtype))
      else:
        leaves.append(next(rest))
    return jax.tree.unflatten(self.treedef, leaves)


# Primitives that call a jaxpr once, its outputs theirs (unlike a loop's or a cond's).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat"})


def _fill_values(jaxpr) -> list:
  """Per output of `jaxpr`, the scalar it is a broadcast of, where it is one (a literal
  broadcast, directly or from inside a nested call such as `jit`), else None."""
  from jax.extend.core import Literal
  producer = {id(v): (eqn, j) for eqn in jaxpr.eqns for j, v in enumerate(eqn.outvars)}

  def value(v):
    if isinstance(v, Literal):
      return v.val if np.ndim(v.val) == 0 else None
    if id(v) not in producer:
      return None  # an input of the jaxpr
    eqn, j = producer[id(v)]
    if eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], Literal):
      return eqn.invars[0].val if np.ndim(eqn.invars[0].val) == 0 else None
    inner = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
    if inner is not None:
      inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
      if len(inner.outvars) == len(eqn.outvars):
        return _fill_values(inner)[j]
    return None

  return [value(v) for v in jaxpr.outvars]


def init_stages(stages: Sequence[Stage], rng: jax.Array, x: PyTree):
  """Initialises every stage in turn on an example input `x` (only its shape matters).

  Returns:
    (params, model_states): two lists of K pytrees.
  """
  params, states = [], []
  for k, stage in enumerate(stages):
    if stage.init is None:
      raise ValueError(f"stage {k} ({stage.name}) has no init; pass its params explicitly")
    p, s = stage.init(jax.random.fold_in(rng, k), x)
    params.append(p)
    states.append(s)
    x, _ = jax.eval_shape(lambda p, s, x, st=stage: st.apply(p, s, x, train=False), p, s, x)
    x = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), x)
  return params, states


def forward(stages: Sequence[Stage], params, model_states, x, *, train: bool = False, rng=None):
  """The synchronous forward of the unsplit network: stages applied in order.

  Returns:
    (y, model_states): the last stage's output and the list of (updated) model states.
  """
  new_states = []
  for k, stage in enumerate(stages):
    r = None if rng is None else jax.random.fold_in(rng, k)
    x, s = stage.apply(params[k], model_states[k], x, train=train, rng=r)
    new_states.append(s)
  return x, new_states


def stage_key(stage_rng, batch):
  """The key of a stage's stochastic layers (dropout) for batch `batch`.

  Derived, not carried: a stage whose layers draw nothing lets XLA drop the hash (on CPU a
  loop per call), and `recompute` rebuilds the forward's key from the stashed batch index.
  """
  return jax.random.fold_in(stage_rng, batch)
