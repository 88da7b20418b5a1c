"""Delay-aware optimiser pieces (optax style) for stages that apply stale gradients.

Stage k applies at each update a gradient that is d = d_k updates stale (BP: 0, DDG: K-1-k,
FDG: 2(K-1-k); see `fdg_jax.delays`). Each method below is a factory taking the delay d and its
hyperparameters. Some methods change the weights the stage's *forward* runs at; they return a
`DelayedTransformation`, an optax transform with a third function, `forward`:

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

Every method except `nesterov_delay` returns the plain transform itself (or the identity) at
d = 0, so BP and the last stage compute bitwise what the plain optimiser computes.

Under `backward="recompute"` a transform may also choose the weights the delayed backward
re-runs the forward at: `backward(params, state) -> params` (the fourth field, identity by
default; `chain` threads it through the components in order).

Methods (SGDM is PyTorch's form, as `optax.sgd`: v <- g + m*v, theta <- theta - eta*v):

1. `lr_by_delay(delay, ramp_steps)`: PipeMare learning-rate rescheduling (Yang et al., MLSys 2021,
   arXiv 1910.05124). Chained AFTER the optimiser: the update is multiplied by d^(-p_t),
   p_t = 1 - min(t / T_r, 1), t = the number of updates this transform applied before (0 at the
   first). A stale stage starts at eta/d and reaches the base schedule after T_r updates. d <= 1:
   the identity. T_r = None: no ramp, the stage keeps eta/d for the whole run (a fixed
   per-stage rate, not PipeMare's annealed one). Memory: one int32 counter. (PipeNAG's public code applies the same rule with
   t counted from 1 and T_r = 7 epochs.)
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
warm-up), live in `fdg_jax.optimizers` and are re-exported here; they are optimisers, not
corrections, and take the base's place (`fdg_jax.optim.make_optimizer` names them).

FDG's gradient shrinking (`fdg_jax.shrink`) is chained first, before everything:
`chain(shrink(beta, k, K), stage_optimizer(...))`. It scales the stage's gradient by
beta_k = beta^(K-1-k). lr_by_delay, spike_compensation, nesterov_delay and the optimiser are
linear in g, so they commute with it; weight_prediction extrapolates the (shrunk) update the
optimiser applied, i.e. what the stage really does. DC sees the shrunk gradient: its correction
term scales by beta_k^2 against the gradient's beta_k (with the adaptive lam_t ~ 1/abs(g) it
scales by beta_k like the gradient, the adaptive form is scale-free there).

Combining hooks: `chain` calls the forwards in the chain's order, so a component that records the
forward weights (dc) sees the weights before any later component moves them; put recording
hooks after weight-moving ones in the chain if both are used (`stage_optimizer` builds one
method at a time).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fdg_jax import plans
from fdg_jax.optimizers import basis_rotation, nadam_warmup  # noqa: F401 (re-exported)

METHODS = ("none", "lr_by_delay", "weight_prediction", "spike_compensation", "dc",
           "nesterov_delay", "error_feedback", "discrepancy_correction")


def _identity_forward(params, state):
  return params, state


def _identity_backward(params, state):
  del state
  return params


class DelayedTransformation(NamedTuple):
  """An optax transform with hooks that pick the weights the stage's forward runs at and,
  under `backward="recompute"`, the weights its delayed backward re-runs the forward at."""
  init: Callable      # params -> state  (as optax)
  update: Callable    # (updates, state, params) -> (updates, state)  (as optax)
  forward: Callable   # (params, state) -> (params_for_forward, state)
  backward: Callable = _identity_backward  # (params, state) -> params_for_backward


def with_forward(tx) -> DelayedTransformation:
  """Any optax GradientTransformation (or DelayedTransformation) as a DelayedTransformation."""
  if isinstance(tx, DelayedTransformation):
    return tx
  return DelayedTransformation(tx.init, tx.update, _identity_forward)


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


def _check_delay(delay) -> int:
  if int(delay) != delay or delay < 0:
    raise ValueError(f"delay must be a non-negative integer, got {delay!r}")
  return int(delay)


def _identity() -> DelayedTransformation:
  return with_forward(optax.identity())


# --------------------------------------------------------------------------------------------
# 1. PipeMare learning-rate rescheduling


class LrByDelayState(NamedTuple):
  count: jax.Array  # int32: updates applied so far


def lr_by_delay(delay: int, ramp_steps: int | None,
                power: float = 1.0) -> optax.GradientTransformation:
  """PipeMare: scales updates by delay^-(power * (1 - min(t/ramp_steps, 1))); chain it AFTER
  the optimiser.

  t counts this transform's updates from 0. delay <= 1 (or ramp_steps == 0, or power == 0):
  the identity. ramp_steps None: no ramp, every update scaled by delay^-power for the whole
  run. PipeMare's rule is power = 1.
  """
  d = _check_delay(delay)
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
  inner: Any         # the inner optimiser's state
  last_update: Any   # the last update the inner optimiser produced (zeros before the first)


def weight_prediction(inner, delay: int, horizon: Optional[float] = None) -> DelayedTransformation:
  """SpecTrain / LWP: the forward runs at theta + s * (inner's last update), s = delay or horizon.

  s == 0: `with_forward(inner)` itself.
  """
  d = _check_delay(delay)
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
  d = _check_delay(delay)
  if not 0.0 < momentum < 1.0:
    raise ValueError(f"spike_compensation needs SGD momentum in (0, 1), got {momentum}")
  if d == 0:
    return optax.sgd(learning_rate, momentum=momentum)
  return optax.chain(_spike_direction(momentum, d), optax.scale_by_learning_rate(learning_rate))


# --------------------------------------------------------------------------------------------
# 4. DC-ASGD delay compensation


class DelayCompensationState(NamedTuple):
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
  d = _check_delay(delay)
  if d == 0:
    return _identity()
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
  _check_delay(delay)
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f"nesterov_delay needs momentum in [0, 1), got {momentum}")
  return chain(optax.scale_by_learning_rate(learning_rate), _nag_increment(momentum))


# --------------------------------------------------------------------------------------------
# 6. Update extrapolation ("error feedback" on the update's lag)


class ErrorFeedbackState(NamedTuple):
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
  d = _check_delay(delay)
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
  d = _check_delay(delay)
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"discrepancy_correction's decay must lie in [0, 1), got {decay}")
  if d == 0:
    return _identity()

  def init_fn(params):
    return DiscrepancyState(increment=jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    inc = jax.tree.map(lambda a, u: decay * a + (1.0 - decay) * u.astype(a.dtype),
                       state.increment, updates)
    return updates, DiscrepancyState(increment=inc)

  def backward_fn(params, state):
    return jax.tree.map(lambda p, a: p - jnp.asarray(d, a.dtype) * a, params, state.increment)

  return DelayedTransformation(init_fn, update_fn, _identity_forward, backward_fn)


# --------------------------------------------------------------------------------------------
# Registry

_HPARAMS = {
    "none": (),
    "lr_by_delay": ("ramp_steps", "power"),
    "weight_prediction": ("horizon",),
    "spike_compensation": (),
    "dc": ("lam", "adaptive", "decay", "lam0", "eps"),
    "nesterov_delay": ("gamma", "learning_rate"),
    "error_feedback": ("strength",),
    "discrepancy_correction": ("discrepancy_decay",),
}


def stage_optimizer(method: str, base, *, delay: int, learning_rate, momentum: float,
                    weight_decay: float, hparams: Optional[dict] = None, optimizer: str = "sgd",
                    nesterov: bool = False) -> DelayedTransformation:
  """Stage k's optimiser for a staleness method, given the plain base optimiser.

  Args:
    method: one of METHODS.
    base: the plain optax optimiser of the stage (`fdg_jax.optim.make_optimizer(...)`), built
      from `optimizer`, learning_rate, momentum, nesterov and weight_decay.
    delay: the stage's gradient delay d_k.
    learning_rate, momentum, weight_decay: the base's (float or optax schedule for the rate).
    hparams: the method's own settings: lr_by_delay {"ramp_steps"} (required, T_r in updates);
      weight_prediction {"horizon"}; dc {"lam", "adaptive", "decay", "lam0", "eps"};
      nesterov_delay {"gamma" (default 0.99), "learning_rate" (default learning_rate/(1-momentum),
      the base's effective step)}. Unknown keys raise.
    optimizer, nesterov: the base's kind, for the methods that replace it (spike_compensation
      needs plain heavy-ball SGD with momentum; nesterov_delay an SGD base).

  Returns "none": with_forward(base); at delay 0 with_forward(base) for every method except
  nesterov_delay (which keeps its rule; see the module docstring). FDG's shrink goes first:
  `chain(shrink(...), stage_optimizer(...))`.
  """
  if "+" in method:
    return _combination(method, base, delay=delay, learning_rate=learning_rate,
                        momentum=momentum, weight_decay=weight_decay, hparams=hparams,
                        optimizer=optimizer, nesterov=nesterov)
  if method not in METHODS:
    raise ValueError(f"unknown staleness method {method!r}; choose one of {METHODS}")
  hparams = dict(hparams or {})
  unknown = sorted(set(hparams) - set(_HPARAMS[method]))
  if unknown:
    raise ValueError(f"staleness method {method!r} takes hparams {_HPARAMS[method]}, "
                     f"got unknown {unknown}")
  d = _check_delay(delay)
  if method in ("spike_compensation", "nesterov_delay") and optimizer != "sgd":
    raise ValueError(f"staleness method {method!r} replaces the SGD rule; it does not apply to "
                     f"optimizer {optimizer!r}")
  if method == "spike_compensation":
    if nesterov:
      raise ValueError("spike_compensation is derived for heavy-ball SGD momentum, not Nesterov")
    if not momentum or not 0.0 < momentum < 1.0:
      raise ValueError(f"spike_compensation needs SGD with momentum in (0, 1), got {momentum!r}")
  if method == "lr_by_delay" and "ramp_steps" not in hparams:
    raise ValueError("lr_by_delay needs hparams['ramp_steps'] (T_r, in updates; PipeNAG's code "
                     "uses 7 epochs)")

  if method == "nesterov_delay":
    gamma = hparams.get("gamma", 0.99)
    lr = hparams.get("learning_rate")
    if lr is None:
      scale = 1.0 / (1.0 - (momentum or 0.0))
      lr = (lambda count: learning_rate(count) * scale) if callable(learning_rate) \
          else learning_rate * scale
    tx = nesterov_delay(lr, d, momentum=gamma)
    return chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx

  if method == "none" or d == 0:
    return with_forward(base)
  if method == "lr_by_delay":
    return chain(base, lr_by_delay(d, hparams["ramp_steps"], hparams.get("power", 1.0)))
  if method == "weight_prediction":
    return weight_prediction(base, d, horizon=hparams.get("horizon"))
  if method == "error_feedback":
    return error_feedback(base, d, strength=hparams.get("strength", 1.0))
  if method == "discrepancy_correction":
    return chain(base, discrepancy_correction(d, hparams.get("discrepancy_decay", 0.9)))
  if method == "spike_compensation":
    tx = spike_compensation(learning_rate, d, momentum)
    return chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else with_forward(tx)
  # dc
  return chain(delay_compensation(d, **hparams), base)


# --------------------------------------------------------------------------------------------
# staleness=auto: the study's choice (benchmarks/delay_robust.py, docs/staleness.md)

AUTO_SGD = {"staleness": "spike_compensation+weight_prediction"}
AUTO_SGD_FDG4 = {"staleness": "nesterov_delay", "nesterov_gamma": 0.9}
AUTO_ADAM = {"optimizer": "basis_rotation", "staleness": "error_feedback",
             "staleness_strength": 0.5}
ROTATED = AUTO_ADAM["optimizer"]
# The Adam family as the study ran it: adamw (adam is the same at weight decay 0, as the
# study ran it), nadam_warmup, and rotated Adam itself. `auto` may replace these, and only
# these, by rotated Adam; muon (studied, but not Adam), lion, optax's nadam, ...: never.
ADAM_FAMILY = ("adam", "adamw", "nadam_warmup", ROTATED)
SGD_MOMENTUM = 0.9  # the only SGD momentum of the study (the MLP, heavy ball)
STUDIED_K = (4, 8)
_ADAM_REMEDY = {k: v for k, v in AUTO_ADAM.items() if k != "optimizer"}


def _ef(strength: float) -> dict:
  return {"staleness": "error_feedback", "staleness_strength": strength}


# family -> {(algorithm, K): (the optimiser the study chose in the family's place, or None for
# the user's; the remedy it chose, or None where none was tried)}. A cell absent: not run.
# sgd: the MLP (spike_compensation+weight_prediction at both K = 8 cells and every width;
#   nesterov_delay 0.9 at FDG K = 4 at widths 96 and 128, error_feedback 0.5 at width 64;
#   DDG K = 4: the lr grid only). adam: the ViT and the GPT (rotated Adam best in every cell;
#   error_feedback 0.5 at FDG K = 4 and 8 on both and at DDG K = 4 on the GPT and the ViT
#   follow-up; DDG K = 8: the ViT, no remedy tried). muon: the GPT (error_feedback, its
#   strength as chosen per cell; the ViT tried no remedy for it; DDG K = 8 not run).
STUDY = {
    "sgd": {("ddg", 4): (None, None), ("fdg", 4): (None, AUTO_SGD_FDG4),
            ("ddg", 8): (None, AUTO_SGD), ("fdg", 8): (None, AUTO_SGD)},
    "adam": {("ddg", 4): (ROTATED, _ADAM_REMEDY), ("fdg", 4): (ROTATED, _ADAM_REMEDY),
             ("ddg", 8): (ROTATED, None), ("fdg", 8): (ROTATED, _ADAM_REMEDY)},
    "muon": {("ddg", 4): (None, _ef(1.0)), ("fdg", 4): (None, _ef(0.5)),
             ("fdg", 8): (None, _ef(1.0))},
}
_FAMILY_NAMES = {"sgd": "SGD with momentum 0.9", "adam": "the Adam family", "muon": "muon"}


def _family(optimizer: str, momentum: float, nesterov: bool) -> tuple[Optional[str], str]:
  """(the study's family of the optimiser or None, what it is when None)."""
  if optimizer == "sgd":
    if nesterov:
      return None, "sgd with Nesterov momentum"
    if not momentum:
      return None, "sgd without momentum"
    if abs(momentum - SGD_MOMENTUM) > 1e-9:
      return None, f"sgd with momentum {momentum:g}; the study ran {SGD_MOMENTUM:g}"
    return "sgd", ""
  if optimizer in ADAM_FAMILY:
    if nesterov and optimizer in ("adam", "adamw"):  # optax's adam(w) turns into NAdam(W)
      return None, f"{optimizer} with nesterov=True"
    return "adam", ""
  if optimizer == "muon":
    return "muon", ""
  return None, optimizer


def _cell(family: str, algorithm: str, K: int):
  """((optimiser, remedy), where) of the study at (algorithm, K), or (None, why not)."""
  cells = STUDY[family]
  lo, hi = STUDIED_K
  name = f"{algorithm.upper()} K={K}"
  if (algorithm, K) in cells:
    return cells[(algorithm, K)], f"at {name}"
  if lo < K < hi and (algorithm, lo) in cells and (algorithm, hi) in cells:
    (o1, r1), (o2, r2) = cells[(algorithm, lo)], cells[(algorithm, hi)]
    return ((o1 if o1 == o2 else None, r1 if r1 == r2 else None),
            f"at both {algorithm.upper()} K={lo} and K={hi}")
  ran = " and ".join(str(k) for a, k in sorted(cells) if a == algorithm)
  return None, f"{name} not studied for {_FAMILY_NAMES[family]}; it ran K = {ran}"


def _describe(fields: dict) -> str:
  return fields["staleness"] + "".join(f", {k} {v:g}" if isinstance(v, float) else f", {k} {v}"
                                       for k, v in fields.items() if k != "staleness")


def recommend(optimizer: str, algorithm: str, *, num_stages: int, momentum: float = 0.0,
              nesterov: bool = False, beta: float = 1.0, backward: str = "stash",
              hparams=()) -> tuple[dict, str]:
  """What `--config.staleness=auto` sets: (config fields, one line saying so).

  Exactly the held-out choices of benchmarks/delay_robust.py (docs/staleness.md, `STUDY`),
  and nothing where the study did not choose:

  - SGD with heavy-ball momentum 0.9 (the MLP): `spike_compensation+weight_prediction` at
    DDG and FDG K = 8; `nesterov_delay` with nesterov_gamma 0.9 at FDG K = 4; nothing at
    DDG K = 4 (no remedy was tried there).
  - The Adam family, `ADAM_FAMILY` (adam, adamw and nadam_warmup, which the ViT and GPT
    studies ran rotated Adam against, and basis_rotation itself): the optimiser becomes
    `basis_rotation` under BP, GPipe and 1F1B (no correction: the study's best BP optimiser,
    so BP and the delayed runs compare one optimiser) and under DDG and FDG at K = 4 to 8;
    with `error_feedback` strength 0.5 at FDG K = 4 to 8 and DDG K = 4, none at DDG K = 5
    to 8 (none was tried at DDG K = 8). adam(w) with nesterov=True (NAdam) is not the
    family. If the user's optimiser parameters (optimizer_kwargs, b1/b2/eps) include one
    that basis_rotation lacks, nothing changes (the remedy was chosen with rotated Adam
    only). Where the optimiser is switched, `trainer.resolve_auto` adds both optimisers'
    state for the config's model to the line (`state_memory`; rotated Adam's was 4.45x
    AdamW's on the study's ViT and 4.27x on its GPT, docs/results/optimizer_cost_*.json).
  - Muon (the GPT): its own optimiser kept, `error_feedback` strength 1 at DDG K = 4 and
    FDG K = 8, 0.5 at FDG K = 4 (each cell's choice); nothing at DDG K = 8 (not run) or
    under BP.
  - Anything else (SGD with another momentum, Nesterov's or none; lion, optax's nadam, ...):
    nothing; no optimiser outside `ADAM_FAMILY` is ever replaced.

  K: the study ran K = 4 and 8. A K in between (5, 6, 7) counts as studied for each of the
  two choices, the optimiser and the remedy, only where the study made that same choice at
  both K = 4 and K = 8 (so the Adam family gets rotated Adam + error_feedback 0.5 under FDG
  and rotated Adam alone under DDG; SGD and Muon get nothing there). K = 2, 3 or above 8:
  nothing, the optimiser included. A delayed schedule other than the study's (beta != 1,
  backward="recompute"): nothing. K = 1 and BP, GPipe, 1F1B have no delay: no correction.

  The learning rate, the warm-up and every other field stay the user's. `hparams`: the names
  of the optimiser parameters the config sets (`config_check.optimizer_hparams`).
  """
  import inspect
  none = {"staleness": "none"}
  family, what = _family(optimizer, momentum, nesterov)
  swappable = family == "adam" and optimizer != ROTATED
  lacking = sorted(set(hparams) - set(inspect.signature(basis_rotation).parameters))
  blocked = (f"{ROTATED}, the study's optimiser for {optimizer}, has no parameter "
             f"{', '.join(lacking)}: set the optimiser and staleness by hand")
  delayed = plans.spec(algorithm).delayed
  if not delayed or num_stages == 1:
    why = f"{algorithm}{' K=1' if delayed else ''}: no delay to correct"
    if swappable and not lacking:
      return {"optimizer": ROTATED, "staleness": "none"}, (
          f"staleness=auto: none ({why}); optimizer {optimizer} -> {ROTATED} (the study's "
          "best optimiser under BP, and its choice under DDG and FDG)")
    return none, f"staleness=auto: none ({why}{'; ' + blocked if swappable else ''})"
  if family is None:
    return none, f"staleness=auto: none (no remedy studied for {what})"
  if beta != 1.0 or backward != "stash":
    return none, (f"staleness=auto: none (the study ran beta 1 and backward stash, not beta "
                  f"{beta:g} with backward {backward})")
  cell, where = _cell(family, algorithm, num_stages)
  if cell is None:
    return none, f"staleness=auto: none ({where})"
  switch, remedy = cell
  switch = switch if switch and switch != optimizer else None
  if switch and lacking:
    return none, f"staleness=auto: none ({blocked})"
  who = _FAMILY_NAMES[family]
  fields = dict(remedy or none)
  if remedy:
    line = f"staleness=auto: {_describe(remedy)}"
  elif where.startswith("at both"):
    line = (f"staleness=auto: none (no remedy common to the study's {algorithm.upper()} "
            f"K={STUDIED_K[0]} and K={STUDIED_K[1]})")
  else:
    line = f"staleness=auto: none (no remedy tried for {who} {where})"
  if switch:
    fields["optimizer"] = switch
    line += f"; optimizer {optimizer} -> {switch} (the study's choice for {who} {where})"
  elif remedy:
    line += f" (the study's choice for {who} {where})"
  return fields, line


def _size(n: int) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n} B"


def state_memory(old_name: str, old: int, new_name: str, new: int, params: int) -> str:
  """The start line's clause on a switched optimiser's state (bytes for the user's model)."""
  ratio = f", {new / old:.2f}x" if old else ""
  return (f"{new_name}'s state {_size(new)} against {old_name}'s {_size(old)} for this "
          f"model's {_size(params)} of parameters (+{_size(new - old)}{ratio})")


def tree_bytes(tree) -> int:
  """The bytes of a pytree's arrays (or of `jax.eval_shape`'s ShapeDtypeStructs)."""
  import math
  return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def parse_methods(method: str) -> tuple[str, ...]:
  """The methods of a combination "a+b+..." (ValueError: unknown, repeated or clashing)."""
  parts = tuple(m.strip() for m in method.split("+"))
  for m in parts:
    if m not in METHODS or m == "none":
      raise ValueError(f"unknown staleness method {m!r} in {method!r}; combine methods of "
                       f"{METHODS[1:]} with '+'")
  if len(set(parts)) != len(parts):
    raise ValueError(f"staleness {method!r} repeats a method")
  if {"spike_compensation", "nesterov_delay"} <= set(parts):
    raise ValueError("spike_compensation and nesterov_delay each replace the SGD rule: "
                     "combine at most one of them")
  if {"dc", "weight_prediction"} <= set(parts):
    raise ValueError("dc compensates the weights the forward ran at and weight_prediction "
                     "moves them: combine at most one of them")
  return parts


def _combination(method, base, *, delay, learning_rate, momentum, weight_decay, hparams,
                 optimizer, nesterov) -> DelayedTransformation:
  """Several methods at once, e.g. "spike_compensation+weight_prediction".

  Built inside out: the update rule (the base, or spike_compensation / nesterov_delay in its
  place), then lr_by_delay after it, error_feedback around that (extrapolating the scaled
  update), dc before it, discrepancy_correction after it (averaging the update applied),
  and weight_prediction around all of it (extrapolating the update the stage really
  applies). `hparams` holds every part's
  settings; each part takes its own keys.
  """
  parts = parse_methods(method)
  hparams = dict(hparams or {})
  unknown = sorted(set(hparams) - {h for m in parts for h in _HPARAMS[m]})
  if unknown:
    raise ValueError(f"staleness {method!r} takes no hparams {unknown}")
  own = lambda m: {h: hparams[h] for h in _HPARAMS[m] if h in hparams}
  build = lambda m, b: stage_optimizer(m, b, delay=delay, learning_rate=learning_rate,
                                       momentum=momentum, weight_decay=weight_decay,
                                       hparams=own(m), optimizer=optimizer, nesterov=nesterov)
  rule = next((m for m in parts if m in ("spike_compensation", "nesterov_delay")), None)
  tx = build(rule, base) if rule else with_forward(base)
  for m in ("lr_by_delay", "error_feedback", "dc", "discrepancy_correction"):
    if m in parts:
      tx = build(m, tx)
  if "weight_prediction" in parts:
    tx = build("weight_prediction", tx)
  return tx
