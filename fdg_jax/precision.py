"""Mixed precision for stages: compute in bfloat16, keep float32 master weights::

    stages = [precision.mixed_precision(s, jnp.bfloat16) for s in stages]
    loss_fn = precision.float32_loss(loss_fn)

A mixed-precision stage casts its floating-point parameters and its input to the compute
dtype, runs the wrapped stage there, and returns its output in the compute dtype. So:

- the parameters, their gradients (the cast's transpose brings them back to float32) and the
  optimizer state stay float32: the update is applied to float32 master weights;
- the activations sent between stages, the cotangents sent back, and the `jax.vjp` residuals
  a stash keeps are in the compute dtype: half the bytes of float32 or less. Layers that
  compute in float32 inside (Flax's BatchNorm and LayerNorm upcast their input for the
  statistics, softmax-style reductions) would otherwise leave activation-sized float32
  residuals; the stage runs under `jax.checkpoint` with a policy that keeps only values
  computed from compute-dtype operands in the compute dtype, so those float32 values are
  recomputed in the backward from the compute-dtype ones they came from (elementwise work;
  `keep_float32_residuals=True` keeps them instead, as plain autodiff would);
- the model state (BatchNorm statistics) keeps its own dtype (float32): its update is computed
  from compute-dtype batch statistics and stored at the state's dtype;
- the loss is computed in float32 from the last stage's output (`float32_loss`).

Integer inputs (token ids) pass through uncast.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from fdg_jax.stages import Stage

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def cast_floating(tree, dtype):
  """`tree` with every floating-point leaf cast to `dtype` (integer leaves untouched)."""
  return jax.tree.map(
      lambda a: a.astype(dtype) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a,
      tree)


def compute_dtype_residuals(compute_dtype):
  """A `jax.checkpoint` policy: save an operation's output for the backward only if it is
  computed in `compute_dtype` from operands of that dtype (or from no floating operand);
  anything else, e.g. a float32 upcast and what follows from it, is recomputed."""
  compute_dtype = jnp.dtype(compute_dtype)

  def policy(prim, *avals, **params):
    del prim
    for key in ("new_dtype", "preferred_element_type"):
      if params.get(key) is not None and jnp.dtype(params[key]) != compute_dtype:
        return False
    return all(a.dtype == compute_dtype for a in avals
               if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating))
  return policy


def mixed_precision(stage: Stage, compute_dtype, *,
                    keep_float32_residuals: bool = False) -> Stage:
  """`stage` computing in `compute_dtype` over float32 parameters (see the module docstring).

  float32 returns `stage` itself (bitwise the same computation).
  """
  compute_dtype = jnp.dtype(compute_dtype)
  if compute_dtype == jnp.float32:
    return stage
  policy = None if keep_float32_residuals else compute_dtype_residuals(compute_dtype)

  def apply(params, model_state, x, *, train=True, rng=None):
    run = lambda p, s, a: stage.apply(p, s, a, train=train, rng=rng)
    if policy is not None:
      run = jax.checkpoint(run, policy=policy)
    y, new_state = run(cast_floating(params, compute_dtype), model_state,
                       cast_floating(x, compute_dtype))
    # The state keeps its dtype (a schedule's state has one fixed layout).
    new_state = jax.tree.map(lambda new, old: new.astype(jnp.result_type(old)), new_state,
                             model_state)
    return cast_floating(y, compute_dtype), new_state

  return Stage(apply=apply, init=stage.init, name=f"{stage.name}[{compute_dtype.name}]")


def float32_loss(loss_fn: Callable) -> Callable:
  """`loss_fn` computed on float32 copies of the outputs (and of floating labels)."""

  def loss(outputs, labels):
    return loss_fn(cast_floating(outputs, jnp.float32), cast_floating(labels, jnp.float32))

  return loss
