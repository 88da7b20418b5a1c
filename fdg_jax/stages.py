"""Stages: the pure functions a network is split into.

A stage k owns parameters theta_k and an optional model state (e.g. BatchNorm running
statistics). The schedules (BP, DDG, FDG) only ever see the two pure functions of a stage:

    init(rng, x) -> (params, model_state)
    apply(params, model_state, x, *, train, rng=None) -> (y, model_state)

`apply` returns the (possibly updated) model state; a stateless stage returns the one it was
given (by convention `{}`). `rng` is a PRNG key for stochastic layers such as dropout; stages
that need none ignore it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax

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
