"""Mixed precision for stages: compute in bfloat16, keep float32 master weights.

    stages = [precision.mixed_precision(s, jnp.bfloat16) for s in stages]
    loss_fn = precision.float32_loss(loss_fn)

A mixed-precision stage casts its floating-point parameters and its input to the compute
dtype, runs the wrapped stage there, and returns its output in the compute dtype. So:
- the parameters, their gradients (the cast's transpose brings them back to float32) and the
  optimizer state stay float32: the update is applied to float32 master weights;
- the activations sent between stages, the cotangents sent back, and the `jax.vjp` residuals
  a stash keeps are in the compute dtype: half the bytes of float32;
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


def mixed_precision(stage: Stage, compute_dtype) -> Stage:
  """`stage` computing in `compute_dtype` over float32 parameters (see the module docstring).

  float32 returns `stage` itself (bitwise the same computation).
  """
  compute_dtype = jnp.dtype(compute_dtype)
  if compute_dtype == jnp.float32:
    return stage

  def apply(params, model_state, x, *, train=True, rng=None):
    y, new_state = stage.apply(cast_floating(params, compute_dtype), model_state,
                               cast_floating(x, compute_dtype), train=train, rng=rng)
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
