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
# staleness=auto: the study's recommendation (benchmarks/delay_robust.py, docs/results.md)

SGD_FAMILY = ("sgd",)


def recommend(optimizer: str, algorithm: str, *, momentum: float = 0.0,
              nesterov: bool = False) -> tuple[dict, str]:
  """What `--config.staleness=auto` sets: (config fields, one line saying so).

  Chosen on held-out data by benchmarks/delay_robust.py (docs/staleness.md), per optimiser
  family and schedule:

  - SGD with heavy-ball momentum, DDG or FDG: spike compensation with linear weight
    prediction (Kosson et al. 2021), the best remedy of the 8-block MLP at K = 8 under both
    schedules (`AUTO_SGD`);
  - SGD without momentum or with Nesterov's: no remedy (none was studied for it);
  - every other optimiser (the Adam family, Muon, Lion, ...): `AUTO_ADAM`, the choice of the
    ViT and GPT studies: `basis_rotation` with `error_feedback` (strength 0.5) under DDG and
    FDG; the optimiser changes for BP too, so that BP and the delayed schedules compare one
    optimiser. The learning rate, the warm-up and the other fields stay the user's.

  Under BP, GPipe and 1F1B (delay 0) no delay correction is set.
  """
  no_delay = algorithm in ("bp", "gpipe", "1f1b")
  if optimizer in SGD_FAMILY:
    if no_delay or not momentum or nesterov:
      why = (f"{algorithm}: no delay to correct" if no_delay
             else "no remedy studied for SGD without heavy-ball momentum")
      return {"staleness": "none"}, f"staleness=auto: none ({why})"
    return dict(AUTO_SGD), ("staleness=auto: " + "+".join(AUTO_SGD["staleness"].split("+"))
                            + " (the study's choice for heavy-ball SGD under DDG and FDG)")
  if no_delay:  # the same optimiser as the delayed schedules, no delay correction
    fields = {"optimizer": AUTO_ADAM["optimizer"], "staleness": "none"}
  else:
    fields = dict(AUTO_ADAM)
  change = fields.get("optimizer")
  line = "staleness=auto: " + fields["staleness"] + "".join(
      f", {k} {v}" for k, v in fields.items() if k not in ("staleness", "optimizer"))
  if change and change != optimizer:
    line += f"; optimizer {optimizer} -> {change} (the study's choice for adaptive optimisers)"
  else:
    fields.pop("optimizer", None)
  return fields, line


AUTO_SGD = {"staleness": "spike_compensation+weight_prediction"}
# The ViT and GPT studies (docs/staleness.md): basis_rotation had the best held-out score at
# every schedule of both, BP included; error_feedback 0.5 was chosen at FDG K = 4 and 8 on the
# ViT and (strength 0.5 or 1, within 1% of each other) on the GPT, and at DDG K = 4 on the GPT
# for both finalists (held-out perplexity 4.09 -> 3.88 with rotated Adam).
# One setting for every delayed schedule (DDG and FDG).
AUTO_ADAM = {"optimizer": "basis_rotation", "staleness": "error_feedback",
             "staleness_strength": 0.5}


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
