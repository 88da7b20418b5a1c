"""The time of a plan's tick on K devices, computed from its calls (a cost model of any plan).

Stage k runs on device k. Each call of the plan (`plans.Call`) takes, on its stage's
device: the forward f_k, the backward b_k (the delayed backward and update), both (FDG's
call), or for the last stage w_{K-1} = f_{K-1} + b_{K-1} (loss, gradient, update); a call on
micro-batch m of a plan that splits the batch into M takes 1/M of that (linear scaling), and
an update call takes nothing. A message crossing boundary k (stage k's output, or the
same-sized cotangent) takes c_k (c_k / M for a micro-batch's). A device runs its calls one
at a time, in the plan's order, tick after tick; a call starts once its device is free and
its inputs have arrived: the batch at once, a message of this tick when its sender's call
has ended plus the transfer, a message of the previous tick likewise. Links are full duplex
and a transfer is not overlapped with its sender's compute.

Two assumptions about ticks:

- synchronous (`synchronous=True`): every tick ends, its last call and its last transfer
  done, before the next starts (as if the host blocked on each);
- asynchronous: the host's dispatch is hidden and the ticks overlap as far as their data
  allow (what `step` does: it returns without waiting); the steady-state tick is the largest
  ratio, over the cycles of the calls' dependencies, of their time to the ticks they span
  (a timed event graph's cycle time).

`tick_time` gives the steady tick's time; the speed-up of a plan over backpropagation on one
device is sum_k w_k over it (`speedup`). `fdg_jax.bench` predicts every registered plan
with it, and its tests check it against the closed forms of BP, DDG, FDG and GPipe.
"""

from __future__ import annotations

from typing import Sequence


def _duration(call, num_stages: int, f, b, M: int) -> float:
  if call.applies_sum:
    return 0.0
  k = call.stage
  if k == num_stages - 1:
    t = f[k] + b[k]
  else:
    t = (f[k] if call.forward else 0.0) + (b[k] if call.backward else 0.0)
  return t / M if M > 1 else t


def _simulate(plan, f, b, c, ticks: int, synchronous: bool) -> list[float]:
  """The end time of each tick (its last call and its last transfer) over `ticks` ticks."""
  K, M = plan.num_stages, plan.microbatches
  free = [0.0] * K           # when each device is next free
  start = 0.0                # the synchronous tick's start
  inbox = {}                 # (receiver, kind, micro) -> arrival time of last tick's message
  ends = []
  for t in range(ticks):
    if synchronous:
      free = [max(x, start) for x in free]
    now, nxt, last = {}, {}, start if synchronous else 0.0
    for call, do_fwd, do_bwd in plan.issued(t, False):
      k, m = call.stage, call.micro
      ready = free[k]
      for kind, where, flag in (("act", call.act, do_fwd), ("cot", call.cot, do_bwd)):
        if where is None or where == "batch" or flag is False:
          continue
        table = now if where == "now" else inbox
        ready = max(ready, table.get((k, kind, m), 0.0))
      end = ready + _duration(call, K, f, b, M)
      free[k] = end
      last = max(last, end)
      scale = 1.0 / M if M > 1 else 1.0
      sends = []
      if do_fwd is not False and call.forward and k < K - 1:
        sends.append((k + 1, "act", c[k] * scale))
      if do_bwd is not False and call.backward and k > 0:
        sends.append((k - 1, "cot", c[k - 1] * scale))
      for j, kind, cost in sends:
        arrival = end + cost
        (now if plan.reads_now(j, kind) else nxt)[(j, kind, m)] = arrival
        last = max(last, arrival)
    inbox = nxt
    ends.append(last)
    if synchronous:
      start = last
  return ends


def _graph(plan, f, b, c):
  """The steady tick's calls as a timed graph: edges (i, j, weight, lag) saying that call j
  of tick t starts no earlier than call i of tick t - lag plus `weight` (i's compute, and
  the transfer where j reads i's message)."""
  K, M = plan.num_stages, plan.microbatches
  calls = [call for call, _, _ in plan.issued(None, False)]
  scale = 1.0 / M if M > 1 else 1.0
  dur = [_duration(call, K, f, b, M) for call in calls]
  edges = []
  by_device = {}
  for i, call in enumerate(calls):
    by_device.setdefault(call.stage, []).append(i)
  for order in by_device.values():  # a device runs its calls in order, tick after tick
    for i, j in zip(order, order[1:]):
      edges.append((i, j, dur[i], 0))
    edges.append((order[-1], order[0], dur[order[-1]], 1))
  senders = {}  # (receiver, kind, micro) -> the call that sends it
  for i, call in enumerate(calls):
    if call.forward and call.stage < K - 1:
      senders[(call.stage + 1, "act", call.micro)] = (i, c[call.stage] * scale)
    if call.backward and call.stage > 0:
      senders[(call.stage - 1, "cot", call.micro)] = (i, c[call.stage - 1] * scale)
  for j, call in enumerate(calls):
    for kind, where in (("act", call.act), ("cot", call.cot)):
      if where in ("now", "inbox"):
        i, transfer = senders[(call.stage, kind, call.micro)]
        edges.append((i, j, dur[i] + transfer, 0 if where == "now" else 1))
  return len(calls), edges


def _cycle_time(plan, f, b, c) -> float:
  """The asynchronous steady tick: the graph's largest cycle ratio, sum of weights over sum
  of lags (Lawler's search: no cycle of w - T * lag is positive at T or above it)."""
  n, edges = _graph(plan, f, b, c)

  def positive_cycle(T) -> bool:
    dist = [0.0] * n
    for _ in range(n):
      changed = False
      for i, j, w, lag in edges:
        if dist[i] + w - T * lag > dist[j] + 1e-12 * max(1.0, abs(dist[j])):
          dist[j] = dist[i] + w - T * lag
          changed = True
      if not changed:
        return False
    return True

  lo, hi = 0.0, sum(w for _, _, w, _ in edges) + 1.0
  for _ in range(200):
    mid = (lo + hi) / 2
    if positive_cycle(mid):
      lo = mid
    else:
      hi = mid
    if hi - lo <= 1e-13 * hi:
      break
  return hi


def tick_time(plan, forward_s: Sequence[float], backward_s: Sequence[float],
              transfer_s: Sequence[float], *, synchronous: bool = True) -> float:
  """Seconds of one steady tick of `plan` on K devices (see the module docstring).

  Args:
    plan: a `plans.Plan` of K stages.
    forward_s, backward_s: f_k and b_k per stage (the last stage's sum is its loss step w).
    transfer_s: c_k for boundaries k = 0..K-2.
    synchronous: ticks one after another (the steady tick simulated), or overlapping as
      their data allow (the largest cycle ratio of the calls' timed graph: the rate a long
      run of ticks settles to).
  """
  K = plan.num_stages
  f, b = list(forward_s), list(backward_s)
  c = list(transfer_s) + [0.0]
  if len(f) != K or len(b) != K or len(c) != K:
    raise ValueError(f"need {K} forward and backward times and {K - 1} transfer times")
  if synchronous:
    ends = _simulate(plan, f, b, c, plan.fill_ticks + 2, True)
    return ends[-1] - ends[-2]
  return _cycle_time(plan, f, b, c)


def speedup(plan, forward_s, backward_s, transfer_s, *, synchronous: bool = True) -> float:
  """Backpropagation on one device (sum_k (f_k + b_k)) over `plan`'s tick on K devices."""
  t = tick_time(plan, forward_s, backward_s, transfer_s, synchronous=synchronous)
  return (sum(forward_s) + sum(backward_s)) / t
