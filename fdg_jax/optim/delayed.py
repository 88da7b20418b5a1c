"""The delayed-transform protocol: an optax transform that may also choose the weights a
stage's forward (and its recomputed backward) runs at.

Stage k applies at each update a gradient that is d = d_k updates stale (BP: 0, DDG: K-1-k,
FDG: 2(K-1-k); see `fdg_jax.delays`). Some staleness remedies change the weights the stage's
*forward* runs at; they are a `DelayedTransformation`, an optax transform with a third
function, `forward`:

  init(params) -> state
  update(updates, state, params) -> (updates, state)         # params: the current weights
  forward(params, state) -> (params_for_forward, state)       # once, right before each forward

Contract with the schedule: `forward` is called exactly once per forward and `update` exactly once
per applied gradient, in the stage's order (FDG: update then forward at a tick; DDG: forward then
update, so up to d+1 forwards are outstanding), and the gradient of forward number i is applied as
update number i (FIFO). All state is a fixed-shape pytree of arrays (counters int32), changed with
pure jnp only, so a call may run under jit and be masked with `jnp.where` on the whole state.
`with_forward` lifts a plain optax transform (identity forward); `chain` is `optax.chain` with the
forward hooks threaded through the components in order (bitwise `optax.chain` without hooks).

Under `backward="recompute"` a transform may also choose the weights the delayed backward
re-runs the forward at: `backward(params, state) -> params` (the fourth field, identity by
default; `chain` threads it through the components in order).

Combining hooks: `chain` calls the forwards in the chain's order, so a component that records the
forward weights (dc) sees the weights before any later component moves them; put recording
hooks after weight-moving ones in the chain if both are used.

The schedule core (`fdg_jax.schedules`, `fdg_jax.pipelines`) depends on this module only; the
remedies (`fdg_jax.optim.remedies`) are built on it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import optax


def identity_forward(params, state):
  """The forward hook of a transform that leaves the forward's weights alone."""
  return params, state


def identity_backward(params, state):
  """The backward hook of a transform that leaves the recomputed backward's weights alone."""
  del state
  return params


class DelayedTransformation(NamedTuple):
  """An optax transform with hooks that pick the weights the stage's forward runs at and,
  under `backward="recompute"`, the weights its delayed backward re-runs the forward at."""
  init: Callable      # params -> state  (as optax)
  update: Callable    # (updates, state, params) -> (updates, state)  (as optax)
  forward: Callable   # (params, state) -> (params_for_forward, state)
  backward: Callable = identity_backward  # (params, state) -> params_for_backward


def with_forward(tx) -> DelayedTransformation:
  """Any optax GradientTransformation (or DelayedTransformation) as a DelayedTransformation."""
  if isinstance(tx, DelayedTransformation):
    return tx
  return DelayedTransformation(tx.init, tx.update, identity_forward)


def _as_optax(tx) -> optax.GradientTransformation:
  return optax.GradientTransformation(tx.init, tx.update)


def chain(*txs) -> DelayedTransformation:
  """`optax.chain` that keeps the forward hooks.

  init and update are `optax.chain`'s own (so the result equals it bitwise); forward threads the
  params through every component's forward in order, each on its own state.
  """
  lifted = [with_forward(tx) for tx in txs]
  base = optax.chain(*[_as_optax(tx) for tx in lifted])
  forwards = [tx.forward for tx in lifted]
  backwards = [tx.backward for tx in lifted]

  def forward_fn(params, state):
    new_state = []
    for s, fwd in zip(state, forwards):
      params, s = fwd(params, s)
      new_state.append(s)
    return params, tuple(new_state)

  def backward_fn(params, state):
    for s, bwd in zip(state, backwards):
      params = bwd(params, s)
    return params

  return DelayedTransformation(base.init, base.update, forward_fn, backward_fn)


def identity() -> DelayedTransformation:
  """The transform that changes nothing (what a remedy is at delay 0)."""
  return with_forward(optax.identity())


def check_delay(delay) -> int:
  """`delay` as an int (ValueError unless it is a non-negative integer)."""
  if int(delay) != delay or delay < 0:
    raise ValueError(f"delay must be a non-negative integer, got {delay!r}")
  return int(delay)
