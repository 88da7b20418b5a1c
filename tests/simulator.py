"""An independent, eager reference of the schedules in docs/algorithms.md (no library code).

Python lists as stashes, explicit message dictionaries between ticks, shrinking applied the way
the FDG paper describes it (each stage scales the cotangent it receives by beta, so the
factors compound) rather than as an optax transform. Messages may be any pytree.

Stochastic stages: with `keys` (stage k's key), the forward of batch b on stage k runs with
`fold_in(keys[k], b)`, the documented contract of `fdg_jax.Schedule` (`_stage_key`); the
backward of that batch re-runs the forward with the same key. Without `keys` the stages get
rng=None.
"""

import collections

import jax
import numpy as np
import optax


def simulate(algorithm, applies, params, states, opt, data, *, beta=1.0, backward="stash",
             probe_ticks=(), loss_fn=None, keys=None):
  """Plain-Python BP/DDG/FDG per docs/algorithms.md. Returns (params, states, updated-per-tick).

  `opt`: one optax transform, or one per stage; a transform with a `forward(params, state)`
  hook (fdg_jax.staleness) is asked, right before each forward of its stage, for the weights
  to run that forward at. With `probe_ticks`, also returns {t: (weight discrepancy, gradient
  cosine)} measured before tick t for the gradient each stage applies at t.
  """
  if loss_fn is None:
    from toy_models import loss_fn
  K = len(applies)
  theta, ms = list(params), list(states)
  opts = [opt] * K if hasattr(opt, "init") else list(opt)  # one transform (a NamedTuple) or K
  opt_states = [o.init(p) for o, p in zip(opts, theta)]
  probes = {}
  key = (lambda k, b: None) if keys is None else (lambda k, b: jax.random.fold_in(keys[k], b))

  def at_forward_weights(k):
    hook = getattr(opts[k], "forward", None)
    if hook is None:
      return theta[k]
    p, opt_states[k] = hook(theta[k], opt_states[k])
    return p
  stash = [collections.deque() for _ in range(K)]
  act_msgs, cot_msgs = {}, {}   # messages sent at the previous tick, keyed by receiver
  trace = []

  def update(k, grads):
    upd, opt_states[k] = opts[k].update(grads, opt_states[k], theta[k])
    theta[k] = optax.apply_updates(theta[k], upd)

  def stale_gradient(k, entry, cot):
    if backward == "stash":   # the weights and state the forward saw
      p, s = entry["params"], entry["state"]
    else:                     # the current weights (or the optimizer's choice) and state
      hook = getattr(opts[k], "backward", None)
      p, s = (theta[k] if hook is None else hook(theta[k], opt_states[k])), ms[k]
    rng = key(k, entry["batch"])
    f = lambda p_, x_: applies[k](p_, s, x_, train=True, rng=rng)[0]
    _, vjp = jax.vjp(f, p, entry["x"])
    return vjp(cot)

  def backward_stage(k, cot):
    entry = stash[k].popleft()
    grads, dx = stale_gradient(k, entry, cot)
    update(k, grads)
    return entry["batch"], dx

  def forward_stage(k, x, batch):
    p = at_forward_weights(k)
    stash[k].append({"params": p, "state": ms[k], "x": x, "batch": batch})
    y, ms[k] = applies[k](p, ms[k], x, train=True, rng=key(k, batch))
    return y

  def last_stage(x, y, batch):
    p = at_forward_weights(K - 1)
    rng = key(K - 1, batch)

    def f(p, x_):
      out, s = applies[K - 1](p, ms[K - 1], x_, train=True, rng=rng)
      return loss_fn(out, y), s
    (_, ms[K - 1]), (grads, dx) = jax.value_and_grad(f, (0, 1), has_aux=True)(p, x)
    update(K - 1, grads)
    return dx

  def flat(tree):
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(tree)])

  def probe():
    """Per stage: ||theta - theta_fwd|| / ||theta|| and cos(stale grad, fresh BP grad)."""
    disc, cos = [None] * K, [None] * K
    for k in range(K - 1):
      if k not in cot_msgs or not stash[k]:
        continue
      entry = stash[k][0]
      now = flat(theta[k])
      disc[k] = np.linalg.norm(now - flat(entry["params"])) / np.linalg.norm(now)
      stale = flat(stale_gradient(k, entry, cot_msgs[k])[0])
      x, y = data[entry["batch"]]

      def full_loss(ps):
        h = x
        for j in range(K):
          h = applies[j](ps[j], ms[j], h, train=True, rng=key(j, entry["batch"]))[0]
        return loss_fn(h, y)
      fresh = flat(jax.grad(full_loss)(theta)[k])
      cos[k] = stale @ fresh / (np.linalg.norm(stale) * np.linalg.norm(fresh))
    return disc, cos

  for t, (x, y) in enumerate(data):
    if t in probe_ticks:
      probes[t] = probe()
    updated = [None] * K
    new_act, new_cot = {}, {}
    if algorithm == "bp":
      h = x
      for k in range(K - 1):
        h = forward_stage(k, h, t)
      cot = last_stage(h, y, t)
      updated[K - 1] = t
      for k in reversed(range(K - 1)):
        updated[k], cot = backward_stage(k, cot)
    elif algorithm == "ddg":
      h = x
      for k in range(K - 1):
        h = forward_stage(k, h, t)
      new_cot[K - 2] = last_stage(h, y, t)
      updated[K - 1] = t
      for k in reversed(range(K - 1)):
        if k in cot_msgs:
          updated[k], dx = backward_stage(k, cot_msgs[k])
          if k > 0:
            new_cot[k - 1] = dx
    elif algorithm == "fdg":
      for k in range(K):
        arrived = (x, y, t) if k == 0 else act_msgs.get(k)
        if k == K - 1:
          if arrived is not None:
            h, lab, b = arrived
            new_cot[K - 2] = last_stage(h, lab, b)
            updated[k] = b
          continue
        if k in cot_msgs:
          shrunk = jax.tree.map(lambda c: beta * c, cot_msgs[k])
          updated[k], dx = backward_stage(k, shrunk)
          if k > 0:
            new_cot[k - 1] = dx
        if arrived is not None:
          h, lab, b = arrived
          new_act[k + 1] = (forward_stage(k, h, b), lab, b)
    else:
      raise ValueError(f"the simulator knows bp, ddg and fdg, not {algorithm!r}")
    act_msgs, cot_msgs = new_act, new_cot
    trace.append(updated)
  if probe_ticks:
    return theta, ms, trace, probes
  return theta, ms, trace


def simulate_microbatched(applies, params, states, opt, data, microbatches, *, loss_fn=None,
                          keys=None):
  """Plain-Python synchronous pipeline (GPipe, 1F1B) per docs/algorithms.md: each batch cut into
  M equal micro-batches, every stage's gradient the mean of the micro-batches' (the loss of
  micro-batch m is its own mean, divided by M), one update per stage per batch. The order of
  the forwards and backwards across devices does not enter: with no delay, it cannot change
  the result. A stage's model state is updated by each micro-batch's forward, m = 0..M-1;
  with `keys`, the forward of micro-batch m of batch t on stage k runs with
  `fold_in(fold_in(keys[k], t), m)`. Returns (params, states, updated-per-tick)."""
  if loss_fn is None:
    from toy_models import loss_fn
  K, M = len(applies), microbatches
  theta, ms = list(params), list(states)
  opts = [opt] * K if hasattr(opt, "init") else list(opt)
  opt_states = [o.init(p) for o, p in zip(opts, theta)]
  trace = []
  for t, (x, y) in enumerate(data):
    n = x.shape[0] // M
    weights = []
    for k in range(K):  # a forward hook (weight prediction) has nothing to predict at d = 0
      hook = getattr(opts[k], "forward", None)
      weights.append(theta[k] if hook is None else hook(theta[k], opt_states[k])[0])
    total = None
    for m in range(M):
      xm, ym = x[m * n:(m + 1) * n], y[m * n:(m + 1) * n]
      rngs = [None if keys is None else jax.random.fold_in(jax.random.fold_in(keys[k], t), m)
              for k in range(K)]

      def loss(ps, xm=xm, ym=ym, rngs=rngs):
        h, new_states = xm, []
        for k in range(K):
          h, s = applies[k](ps[k], ms[k], h, train=True, rng=rngs[k])
          new_states.append(s)
        return loss_fn(h, ym) / M, new_states

      grads, new_states = jax.grad(loss, has_aux=True)(weights)
      ms = list(new_states)
      total = grads if total is None else jax.tree.map(lambda a, b: a + b, total, grads)
    for k in range(K):
      upd, opt_states[k] = opts[k].update(total[k], opt_states[k], theta[k])
      theta[k] = optax.apply_updates(theta[k], upd)
    trace.append([t] * K)
  return theta, ms, trace
