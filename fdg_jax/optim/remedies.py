"""The staleness remedies: per-stage optax transforms that correct for stale gradients.

Each remedy is a factory taking the stage's delay d = d_k (see `fdg_jax.delays`) and its
hyperparameters; those that move the weights the forward (or the recomputed backward) runs
at return a `DelayedTransformation` (`fdg_jax.optim.delayed`). Every remedy except
`nesterov_delay` is the plain transform itself (or the identity) at d = 0, so BP and the
last stage compute bitwise what the plain optimiser computes. Which remedy a config names,
its settings and how several combine: `fdg_jax.optim.methods`.

Remedies (SGDM is PyTorch's form, as `optax.sgd`: v <- g + m*v, theta <- theta - eta*v):

1. `lr_by_delay(delay, ramp_steps)`: PipeMare learning-rate rescheduling (Yang et al., MLSys 2021,
   arXiv 1910.05124). Chained AFTER the optimiser: the update is multiplied by d^(-p_t),
   p_t = 1 - min(t / T_r, 1), t = the number of updates this transform applied before (0 at the
   first). A stale stage starts at eta/d and reaches the base schedule after T_r updates. d <= 1:
   the identity. T_r = None: no ramp, the stage keeps eta/d for the whole run (a fixed
   per-stage rate, not PipeMare's annealed one). Memory: one int32 counter. (PipeNAG's public
   code applies the same rule with t counted from 1 and T_r = 7 epochs.)
2. `weight_prediction(inner, delay, horizon=None)`: linear weight prediction (SpecTrain, Chen et
   al. 2018, arXiv 1809.02839; LWP of Kosson et al., MLSys 2021, arXiv 2003.11666). The forward
   runs at theta_hat = theta + s * u_last, u_last the last update `inner` produced, s = d (or
   `horizon`). For SGDM at a constant rate u_last = -eta*v, so theta_hat = theta - s*eta*v, the
   papers' form. Memory: one copy of the weights (u_last) on top of `inner`'s state.
3. `spike_compensation(learning_rate, delay, momentum)`: Kosson et al. (arXiv 2003.11666):
   v <- m*v + g, theta <- theta - eta*(a*v + b*g), a = m^D, b = (1 - m^D)/(1 - m). A gradient
   applies at arrival what undelayed SGDM would have applied over the D missed steps, and
   afterwards SGDM's response exactly. D = 0: `optax.sgd(learning_rate, momentum=momentum)`.
   Memory: as SGDM (one velocity).
4. `delay_compensation(delay, lam, adaptive, decay, lam0, eps)`: DC-ASGD (Zheng et al., ICML 2017,
   arXiv 1609.08326). Chained BEFORE the optimiser: g <- g + lam * g*g*(theta_now - theta_fwd),
   theta_fwd the weights the gradient's forward ran at (recorded by the `forward` hook into a ring
   of d+1 slots). Adaptive (DC-ASGD-a): M <- decay*M + (1-decay)*g*g (the incoming gradient),
   lam_t = lam0 / sqrt(M + eps) elementwise. Memory: (d+1) copies of the weights (+1 for M).
5. `nesterov_delay(learning_rate, delay, momentum=0.99)`: PipeNAG (Ajanthan et al., ICML 2025,
   arXiv 2505.01099). With Delta_t = theta_t - theta_{t-1} (the last increment, in the state)
   and gamma = `momentum`: the forward runs at the look-ahead theta + gamma*Delta; the update is
   theta_{t+1} = theta_t + gamma*Delta_t - eta*(1-gamma)*g. Decision: the same rule at every
   stage, d = 0 included (as PipeNAG does): at d = 0 it is Nesterov's method in Sutskever's
   look-ahead form with step eta*(1-gamma), not plain SGD, so it has no bitwise d = 0 reduction.
   Its effective step is eta (heavy ball: eta*(1-gamma)/(1-gamma)), against eta/(1-m) for
   PyTorch SGDM; `stage_optimizer` therefore passes eta_base/(1-m_base) by default. The delay
   enters only through when the stale gradient arrives (the look-ahead does not depend on d).
   Memory: one copy of the weights (Delta).
6. `error_feedback(inner, delay, strength)`: update extrapolation, applied = u_t + strength *
   d * (u_t - u_{t-1}), u_t `inner`'s update: an update-level, optimiser-agnostic correction
   with one buffer, this library's construction in place of the error feedback of Zmushko
   et al. (arXiv 2606.30634), whose exact form could not be found. Memory: one weight copy.
7. `discrepancy_correction(delay, decay)`: PipeMare's weight reconstruction (arXiv 1910.05124)
   for `backward="recompute"`. Chained AFTER the optimiser: delta <- decay*delta + (1-decay) *
   (theta_new - theta_old); the recompute backward runs at theta - d*delta (the schedule
   asks the transform's `backward` hook). Inert under `stash`. Memory: one weight copy.

Optimisers with a geometry meant to tolerate delay, `basis_rotation` (Adam in per-matrix
eigenbases, arXiv 2602.03515) and `nadam_warmup` (PipeNAG's NAdam with PyTorch's momentum
warm-up), live in `fdg_jax.optim.adaptive`; they are optimisers, not corrections, and take
the base's place (`fdg_jax.optim.make_optimizer` names them).

FDG's gradient shrinking (`fdg_jax.optim.shrinking`) is chained first, before everything:
`chain(shrink(beta, k, K), stage_optimizer(...))`. It scales the stage's gradient by
beta_k = beta^(K-1-k). lr_by_delay, spike_compensation, nesterov_delay and the optimiser are
linear in g, so they commute with it; weight_prediction extrapolates the (shrunk) update the
optimiser applied, i.e. what the stage really does. DC sees the shrunk gradient: its correction
term scales by beta_k^2 against the gradient's beta_k (with the adaptive lam_t ~ 1/abs(g) it
scales by beta_k like the gradient, the adaptive form is scale-free there).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fdg_jax.optim.delayed import (DelayedTransformation, chain, check_delay, identity,
                                   identity_forward, with_forward)


# --------------------------------------------------------------------------------------------
# 1. PipeMare learning-rate rescheduling


class LrByDelayState(NamedTuple):
  """The state of `lr_by_delay`."""
  count: jax.Array  # int32: updates applied so far


def lr_by_delay(delay: int, ramp_steps: int | None,
                power: float = 1.0) -> optax.GradientTransformation:
  """PipeMare: scales updates by delay^-(power * (1 - min(t/ramp_steps, 1))); chain it AFTER
  the optimiser.

  t counts this transform's updates from 0. delay <= 1 (or ramp_steps == 0, or power == 0):
  the identity. ramp_steps None: no ramp, every update scaled by delay^-power for the whole
  run. PipeMare's rule is power = 1.
  """
  d = check_delay(delay)
  if power < 0:
    raise ValueError(f"power must be >= 0, got {power}")
  if power == 0:
    return optax.identity()
  if ramp_steps is None:
    return optax.identity() if d <= 1 else optax.scale(float(d) ** -power)
  if ramp_steps < 0:
    raise ValueError(f"ramp_steps must be >= 0 (or None: no ramp), got {ramp_steps}")
  if d <= 1 or ramp_steps == 0:
    return optax.identity()
  ramp = float(ramp_steps)

  def init_fn(params):
    del params
    return LrByDelayState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    p = power * (1.0 - jnp.minimum(state.count.astype(jnp.float32) / ramp, 1.0))
    factor = jnp.power(jnp.float32(d), -p)
    updates = jax.tree.map(lambda u: u * factor.astype(u.dtype), updates)
    return updates, LrByDelayState(count=optax.safe_int32_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------------------------
# 2. Linear weight prediction


class WeightPredictionState(NamedTuple):
  """The state of `weight_prediction`."""
  inner: Any         # the inner optimiser's state
  last_update: Any   # the last update the inner optimiser produced (zeros before the first)


def weight_prediction(inner, delay: int, horizon: Optional[float] = None) -> DelayedTransformation:
  """SpecTrain / LWP: the forward runs at theta + s * (inner's last update), s = delay or horizon.

  s == 0: `with_forward(inner)` itself.
  """
  d = check_delay(delay)
  s = d if horizon is None else horizon
  if s < 0:
    raise ValueError(f"horizon must be >= 0, got {s}")
  inner = with_forward(inner)
  if s == 0:
    return inner

  def init_fn(params):
    return WeightPredictionState(inner=inner.init(params),
                                 last_update=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    updates, inner_state = inner.update(updates, state.inner, params)
    return updates, WeightPredictionState(inner=inner_state, last_update=updates)

  def forward_fn(params, state):
    params, inner_state = inner.forward(params, state.inner)
    predicted = jax.tree.map(lambda p, u: p + jnp.asarray(s, u.dtype) * u, params,
                             state.last_update)
    return predicted, WeightPredictionState(inner=inner_state, last_update=state.last_update)

  def backward_fn(params, state):
    return inner.backward(params, state.inner)

  return DelayedTransformation(init_fn, update_fn, forward_fn, backward_fn)


# --------------------------------------------------------------------------------------------
# 3. Spike compensation


class SpikeCompensationState(NamedTuple):
  """The state of `spike_compensation`."""
  velocity: Any


def _spike_direction(momentum: float, delay: int) -> optax.GradientTransformation:
  a = momentum ** delay
  b = (1.0 - momentum ** delay) / (1.0 - momentum)

  def init_fn(params):
    return SpikeCompensationState(velocity=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    velocity = jax.tree.map(lambda g, v: g + momentum * v, updates, state.velocity)
    direction = jax.tree.map(lambda v, g: a * v + b * g, velocity, updates)
    return direction, SpikeCompensationState(velocity=velocity)

  return optax.GradientTransformation(init_fn, update_fn)


def spike_compensation(learning_rate, delay: int, momentum: float) -> optax.GradientTransformation:
  """Kosson et al.: v <- m v + g; theta <- theta - eta (m^D v + (1-m^D)/(1-m) g).

  D = 0: exactly `optax.sgd(learning_rate, momentum=momentum)`.
  """
  d = check_delay(delay)
  if not 0.0 < momentum < 1.0:
    raise ValueError(f"spike_compensation needs SGD momentum in (0, 1), got {momentum}")
  if d == 0:
    return optax.sgd(learning_rate, momentum=momentum)
  return optax.chain(_spike_direction(momentum, d), optax.scale_by_learning_rate(learning_rate))


# --------------------------------------------------------------------------------------------
# 4. DC-ASGD delay compensation


class DelayCompensationState(NamedTuple):
  """The state of `delay_compensation`."""
  ring: Any                # per leaf (delay+1, *shape): forward weights, slot = forward no. % size
  forward_slot: jax.Array  # int32: the slot the next forward writes
  update_slot: jax.Array   # int32: the slot the next update reads
  mean_square: Any         # per leaf M (adaptive) or () when not adaptive


def delay_compensation(delay: int, lam: float = 0.04, adaptive: bool = False, decay: float = 0.95,
                       lam0: float = 2.0, eps: float = 1e-7) -> DelayedTransformation:
  """DC-ASGD: g <- g + lam * g*g*(theta_now - theta_fwd); chain it BEFORE the optimiser.

  Its forward hook records the forward weights in a ring of delay+1 slots (enough for DDG's
  delay+1 outstanding forwards). adaptive: M <- decay*M + (1-decay)*g*g, lam_t = lam0/sqrt(M+eps).
  delay == 0: the identity (theta_now == theta_fwd).
  """
  d = check_delay(delay)
  if d == 0:
    return identity()
  size = d + 1

  def init_fn(params):
    ring = jax.tree.map(lambda p: jnp.repeat(p[None], size, axis=0), params)
    mean_square = jax.tree.map(jnp.zeros_like, params) if adaptive else ()
    zero = jnp.zeros([], jnp.int32)
    return DelayCompensationState(ring=ring, forward_slot=zero, update_slot=zero,
                                  mean_square=mean_square)

  def forward_fn(params, state):
    slot = state.forward_slot
    ring = jax.tree.map(lambda r, p: r.at[slot].set(p.astype(r.dtype)), state.ring, params)
    return params, state._replace(ring=ring, forward_slot=(slot + 1) % size)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("delay_compensation needs the current params in update")
    slot = state.update_slot
    then = jax.tree.map(lambda r: r[slot], state.ring)
    if adaptive:
      mean_square = jax.tree.map(lambda m, g: decay * m + (1.0 - decay) * g * g,
                                 state.mean_square, updates)
      updates = jax.tree.map(
          lambda g, p, q, m: g + lam0 / jnp.sqrt(m + eps) * g * g * (p - q),
          updates, params, then, mean_square)
    else:
      mean_square = state.mean_square
      updates = jax.tree.map(lambda g, p, q: g + lam * g * g * (p - q), updates, params, then)
    return updates, state._replace(update_slot=(slot + 1) % size, mean_square=mean_square)

  return DelayedTransformation(init_fn, update_fn, forward_fn)


# --------------------------------------------------------------------------------------------
# 5. PipeNAG


class NesterovDelayState(NamedTuple):
  """The state of `nesterov_delay`."""
  increment: Any  # Delta_t = theta_t - theta_{t-1}, the last update applied


def _nag_increment(momentum: float) -> DelayedTransformation:
  """Takes -eta*g, returns gamma*Delta + (1-gamma)*(-eta*g); forward at theta + gamma*Delta."""

  def init_fn(params):
    return NesterovDelayState(increment=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    increment = jax.tree.map(lambda u, inc: momentum * inc + (1.0 - momentum) * u, updates,
                             state.increment)
    return increment, NesterovDelayState(increment=increment)

  def forward_fn(params, state):
    ahead = jax.tree.map(lambda p, inc: p + momentum * inc, params, state.increment)
    return ahead, state

  return DelayedTransformation(init_fn, update_fn, forward_fn)


def nesterov_delay(learning_rate, delay: int, momentum: float = 0.99) -> DelayedTransformation:
  """PipeNAG: forward at theta + gamma*Delta; theta <- theta + gamma*Delta - eta*(1-gamma)*g.

  The same rule at every delay, 0 included (a (1-gamma)-scaled Nesterov method there).
  """
  check_delay(delay)
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f"nesterov_delay needs momentum in [0, 1), got {momentum}")
  return chain(optax.scale_by_learning_rate(learning_rate), _nag_increment(momentum))


# --------------------------------------------------------------------------------------------
# 6. Update extrapolation ("error feedback" on the update's lag)


class ErrorFeedbackState(NamedTuple):
  """The state of `error_feedback`."""
  inner: Any
  last_update: Any   # the inner optimiser's previous update (zeros before the first)
  seen: jax.Array    # int32: 1 once there was a previous update


def error_feedback(inner, delay: int, strength: float = 1.0) -> DelayedTransformation:
  """Applies u_t + strength * d * (u_t - u_{t-1}), u_t the inner optimiser's update.

  An update-level correction with one extra buffer, for any optimiser: a stale stage's
  updates lag the ones fresh gradients would give by about d steps, so the update is
  extrapolated d steps along its own recent change (the first update has no previous one
  and is applied as it is). This is this library's construction, not the published
  error-feedback correction of Zmushko et al. (arXiv 2606.30634), whose exact form could
  not be found (described as update-level, optimiser-agnostic, one buffer). d == 0 (or
  strength 0): `with_forward(inner)` itself. Memory: one copy of the weights.
  """
  d = check_delay(delay)
  inner = with_forward(inner)
  if d == 0 or strength == 0:
    return inner
  c = float(strength) * d

  def init_fn(params):
    return ErrorFeedbackState(inner=inner.init(params),
                              last_update=jax.tree.map(jnp.zeros_like, params),
                              seen=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    u, inner_state = inner.update(updates, state.inner, params)
    scale = jnp.where(state.seen > 0, c, 0.0)
    out = jax.tree.map(lambda a, b: a + (scale * (a - b)).astype(a.dtype), u, state.last_update)
    return out, ErrorFeedbackState(inner=inner_state, last_update=u,
                                   seen=jnp.ones([], jnp.int32))

  def forward_fn(params, state):
    params, inner_state = inner.forward(params, state.inner)
    return params, state._replace(inner=inner_state)

  def backward_fn(params, state):
    return inner.backward(params, state.inner)

  return DelayedTransformation(init_fn, update_fn, forward_fn, backward_fn)


# --------------------------------------------------------------------------------------------
# 7. PipeMare's discrepancy correction (for backward="recompute")


class DiscrepancyState(NamedTuple):
  """The state of `discrepancy_correction`."""
  increment: Any  # delta: the decayed average of the weight increments


def discrepancy_correction(delay: int, decay: float = 0.9) -> DelayedTransformation:
  """PipeMare's weight reconstruction for the delayed backward; chain it AFTER the optimiser.

  delta <- decay * delta + (1 - decay) * (theta_new - theta_old) at every update (delta = 0
  at first), and a `recompute` backward re-runs the forward at theta - d * delta, an estimate
  of the weights the forward ran at d updates earlier, instead of the current theta (Yang et
  al., MLSys 2021, arXiv 1910.05124; the form w_bwd = w - (tau_fwd - tau_bwd) delta, with
  tau_bwd = 0 here; its decay is a setting, not taken from the paper). Under `stash` the
  backward already runs at the forward's weights and the hook is never called. d == 0: the
  identity. Memory: one copy of the weights.
  """
  d = check_delay(delay)
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"discrepancy_correction's decay must lie in [0, 1), got {decay}")
  if d == 0:
    return identity()

  def init_fn(params):
    return DiscrepancyState(increment=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    inc = jax.tree.map(lambda a, u: decay * a + (1.0 - decay) * u.astype(a.dtype),
                       state.increment, updates)
    return updates, DiscrepancyState(increment=inc)

  def backward_fn(params, state):
    return jax.tree.map(lambda p, a: p - jnp.asarray(d, a.dtype) * a, params, state.increment)

  return DelayedTransformation(init_fn, update_fn, identity_forward, backward_fn)
