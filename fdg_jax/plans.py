"""Schedules as data: a tick plan, and everything derived from it.

A **plan** says, for one tick, which calls each stage makes and in which order, and for each
call where its inputs come from: the activation sent by the stage below (or the batch) and
the cotangent sent by the stage above, each sent either earlier in this tick ("now") or at
the previous tick ("inbox"). A plan is a pure value computed from (K, M) alone; no model::

    call = Call(stage, forward, backward, act="now"|"inbox"|"batch", cot="now"|"inbox"|None)

A stage's call runs its delayed backward (pop the oldest stash entry, vjp, update) and then
its forward (stash, send), either or both, as the schedules' stage work does; the last
stage's call is its loss, gradient and update. Within a tick the calls run in the plan's
order; a message read "now" must have been sent by an earlier call of the tick.

From the plan, by simulating its dataflow over ticks (`Derived`), come: each stage's delay
d_k (ticks between forwarding a batch and applying its gradient), its ring size (the most
stash entries it holds at once), its warm-up flags (whether a message has arrived at tick t),
the first tick from which every stage works (`fill_ticks`), and the fused engine's issue
order (`old_messages_first`). `grid` prints the plan as a (tick x stage) table.

Every schedule is declared once, in the registry at the end of this module (`register`,
`spec`, `names`): its plan factory and what it accepts (options, engines, replicas, whether
its gradients are delayed). Everything else that depends on a schedule's name reads it.

GPipe and 1F1B, the synchronous pipelines, are plans of micro-batch actions per device
(`microbatch_order`): F (forward of micro-batch m), B (its backward, gradients accumulated),
then one update per stage at the end of the tick (`fdg_jax.pipelines`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Optional

SOURCES = ("batch", "now", "inbox")


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a stage in a tick: its backward and/or forward (see the module docstring).

  For the last stage, forward = backward = True (loss, gradient, update) and cot is None."""
  stage: int
  forward: bool
  backward: bool
  act: Optional[str]   # where the forward's activation comes from (None: no forward)
  cot: Optional[str]   # where the backward's cotangent comes from (None: no backward / last)

  def __post_init__(self):
    for name in ("act", "cot"):
      v = getattr(self, name)
      if v is not None and v not in SOURCES:
        raise ValueError(f"Call.{name} must be one of {SOURCES} or None, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The calls of one tick, in order, for K stages (a tuple of `Call`; see the module
  docstring)."""
  name: str
  num_stages: int
  calls: tuple

  def __post_init__(self):
    validate(self)

  @functools.cached_property
  def derived(self) -> "Derived":
    return derive(self)

  @property
  def delays(self) -> tuple[int, ...]:
    return self.derived.delays

  @property
  def ring_sizes(self) -> tuple[int, ...]:
    return self.derived.ring_sizes

  @property
  def fill_ticks(self) -> int:
    return self.derived.fill_ticks

  def flags(self, k: int, t):
    """(forwards, backwards) of stage k at tick t: host int -> Python bools, traced int ->
    traced bools, None (past the fill) -> True, True. For the last stage, (active, active)."""
    first_f, first_b = self.derived.first_forward[k], self.derived.first_backward[k]
    if t is None:
      return True, True
    fwd = True if first_f == 0 else (t >= first_f)
    bwd = True if first_b == 0 else (t >= first_b)
    if k == self.num_stages - 1:
      return fwd, fwd
    return fwd, bwd

  def issued(self, t, old_messages_first: bool) -> tuple:
    """The calls an engine issues at tick t, in its issue order (`issue_order`), each as
    (call, forwards, backwards) with the flags of `flags`; a call with neither is left out.
    For a host int or None the answer is computed once per tick of the fill (every tick
    from `fill_ticks` on is the same), so that the interpreter's host cost per tick is the
    hand-written schedules'."""
    if t is None or isinstance(t, int):
      key = (None if t is None or t >= self.fill_ticks else t, bool(old_messages_first))
      cache = self._issued_by_tick
      if key not in cache:
        cache[key] = self._issued(*key)
      return cache[key]
    return self._issued(t, old_messages_first)

  @functools.cached_property
  def _issued_by_tick(self) -> dict:
    return {}

  def _issued(self, t, old_messages_first) -> tuple:
    out = []
    for i in self.issue_order(old_messages_first):
      call = self.calls[i]
      fwd, bwd = self.flags(call.stage, t)
      fwd = fwd if call.forward else False
      bwd = bwd if call.backward else False
      if fwd is not False or bwd is not False:
        out.append((call, fwd, bwd))
    return tuple(out)

  def reads_now(self, k: int, kind: str) -> bool:
    """Whether stage k reads its `kind` message ("act" or "cot") in the tick it is sent."""
    return (k, kind) in self._read_now

  @functools.cached_property
  def _read_now(self) -> frozenset:
    # asked once per message per tick by the interpreter: a set, not a scan of the calls
    return frozenset((c.stage, kind) for c in self.calls for kind, where in
                     (("act", c.act), ("cot", c.cot)) if where == "now")

  def reads_inbox(self, k: int, kind: str) -> bool:
    """Whether stage k reads its `kind` message at the tick after it is sent."""
    return any(c.stage == k and (c.act if kind == "act" else c.cot) == "inbox"
               for c in self.calls)

  @property
  def decoupled(self) -> bool:
    """Whether every call reads only messages of the previous tick (FDG): a tick's stages
    are then independent, and can run as one SPMD program."""
    return all("now" not in (c.act, c.cot) for c in self.calls)

  @property
  def old_messages_first(self) -> bool:
    """The order in which the fused engine issues a tick's calls: True reverses the plan's
    order within each group of calls that read only messages of the previous tick, so that
    each message of tick t-1 is read before the call replacing it runs (XLA then updates
    the inbox in place instead of copying it)."""
    return any(c.act == "inbox" or c.cot == "inbox" for c in self.calls)

  def issue_order(self, old_messages_first: bool) -> tuple[int, ...]:
    """Indices of `calls` in the order an engine issues them. With `old_messages_first`,
    each maximal run of consecutive calls that read nothing sent "now" is reversed."""
    return self._issue_orders[bool(old_messages_first)]

  @functools.cached_property
  def _issue_orders(self) -> dict:
    order, run = [], []
    for i, c in enumerate(self.calls):
      if "now" in (c.act, c.cot):
        order += run[::-1] + [i]
        run = []
      else:
        run.append(i)
    return {False: tuple(range(len(self.calls))), True: tuple(order + run[::-1])}

  def grid(self, ticks: int | None = None) -> str:
    """The plan over `ticks` ticks as text: one row per tick, one column per stage, each cell
    the batches that stage forwards (F) and applies (B) at that tick."""
    ticks = ticks or self.fill_ticks + 2
    events = self.derived.events(ticks)
    head = "tick | " + " | ".join(f"stage {k}" for k in range(self.num_stages))
    rows = [head, "-" * len(head)]
    for t in range(ticks):
      cells = []
      for k in range(self.num_stages):
        f = [b for (tt, kk, kind, b) in events if tt == t and kk == k and kind == "F"]
        b = [b for (tt, kk, kind, b) in events if tt == t and kk == k and kind == "B"]
        cells.append(" ".join([f"F{x}" for x in f] + [f"B{x}" for x in b]) or ".")
      rows.append(f"{t:4d} | " + " | ".join(f"{c:7s}" for c in cells))
    return "\n".join(rows)


def validate(plan: Plan) -> None:
  """One clear ValueError for a plan that cannot run: calls out of range, a stage whose
  forwards and backwards are missing, a message read "now" before it is sent."""
  K = plan.num_stages
  if K < 1:
    raise ValueError(f"a plan needs at least one stage, got {K}")
  seen_f, seen_b, sent = set(), set(), set()
  for i, c in enumerate(plan.calls):
    if not 0 <= c.stage < K:
      raise ValueError(f"{plan.name}: call {i} is on stage {c.stage} of {K}")
    last = c.stage == K - 1
    if last and not (c.forward and c.backward and c.cot is None):
      raise ValueError(f"{plan.name}: the last stage's call does its loss, gradient and "
                       f"update (forward=backward=True, cot=None), not {c}")
    if c.forward:
      if c.act is None:
        raise ValueError(f"{plan.name}: call {i} forwards with no activation source")
      if (c.act == "batch") != (c.stage == 0):
        raise ValueError(f"{plan.name}: call {i}: only stage 0 reads the batch")
      if c.act == "now" and ("act", c.stage) not in sent:
        raise ValueError(f"{plan.name}: call {i} reads stage {c.stage - 1}'s activation of "
                         "this tick before it is sent")
      seen_f.add(c.stage)
      if c.stage < K - 1:
        sent.add(("act", c.stage + 1))
    if c.backward and not last:
      if c.cot is None:
        raise ValueError(f"{plan.name}: call {i} backwards with no cotangent source")
      if c.cot == "now" and ("cot", c.stage) not in sent:
        raise ValueError(f"{plan.name}: call {i} reads stage {c.stage + 1}'s cotangent of "
                         "this tick before it is sent")
      seen_b.add(c.stage)
    if c.backward and c.stage > 0:
      sent.add(("cot", c.stage - 1))
  missing = [k for k in range(K) if k not in seen_f or (k < K - 1 and k not in seen_b)]
  if missing:
    raise ValueError(f"{plan.name}: stages {missing} never forward or never backward")


@dataclasses.dataclass(frozen=True)
class Derived:
  """What a plan implies, found by running its dataflow over ticks with batch indices."""
  plan: Plan
  delays: tuple
  ring_sizes: tuple
  first_forward: tuple
  first_backward: tuple
  fill_ticks: int

  def events(self, ticks: int):
    return _simulate(self.plan, ticks)[0]


def _simulate(plan: Plan, ticks: int):
  """Runs the plan's messages for `ticks` ticks. Returns (events [(t, k, "F"|"B", batch)],
  the most stash entries each stage held at once)."""
  K = plan.num_stages
  inbox_act, inbox_cot = {}, {}
  stash = [[] for _ in range(K)]
  peak = [0] * K
  events = []
  for t in range(ticks):
    now_act, now_cot, next_act, next_cot = {}, {}, {}, {}
    for c in plan.calls:
      k = c.stage
      reads = lambda src, now, inbox: (now.get(k) if src == "now" else inbox.get(k))
      if k == K - 1:
        b = t if c.act == "batch" else reads(c.act, now_act, inbox_act)
        if b is None:
          continue
        events += [(t, k, "F", b), (t, k, "B", b)]
        if k > 0:
          (now_cot if _reader_reads_now(plan, k - 1) else next_cot)[k - 1] = b
        continue
      if c.backward:
        b = reads(c.cot, now_cot, inbox_cot)
        if b is not None and stash[k]:
          got = stash[k].pop(0)
          assert got == b, (plan.name, t, k, got, b)  # FIFO
          events.append((t, k, "B", b))
          if k > 0:
            (now_cot if _reader_reads_now(plan, k - 1) else next_cot)[k - 1] = b
      if c.forward:
        b = t if c.act == "batch" else reads(c.act, now_act, inbox_act)
        if b is not None:
          stash[k].append(b)
          peak[k] = max(peak[k], len(stash[k]))
          events.append((t, k, "F", b))
          (now_act if _act_read_now(plan, k + 1) else next_act)[k + 1] = b
    inbox_act, inbox_cot = next_act, next_cot
  return events, peak


def _act_read_now(plan: Plan, k: int) -> bool:
  return any(c.stage == k and c.forward and c.act == "now" for c in plan.calls)


def _reader_reads_now(plan: Plan, k: int) -> bool:
  return any(c.stage == k and c.backward and c.cot == "now" for c in plan.calls)


def derive(plan: Plan) -> Derived:
  K = plan.num_stages
  ticks = 4 * K + 4
  events, peak = _simulate(plan, ticks)
  fwd = {(k, b): t for t, k, kind, b in events if kind == "F"}
  bwd = {(k, b): t for t, k, kind, b in events if kind == "B"}
  delays, first_f, first_b = [], [], []
  for k in range(K):
    lags = {bwd[(k, b)] - fwd[(k, b)] for (kk, b) in fwd if kk == k and (k, b) in bwd}
    if len(lags) != 1:
      raise ValueError(f"{plan.name}: stage {k} applies its batches with varying delays "
                       f"{sorted(lags)}; a plan must give each stage one delay")
    delays.append(lags.pop())
    first_f.append(min(t for (kk, _), t in fwd.items() if kk == k))
    first_b.append(min(t for (kk, _), t in bwd.items() if kk == k))
  rings = [0 if k == K - 1 else peak[k] for k in range(K)]
  fill = max(max(first_f), max(first_b[:K - 1] or [0]), first_f[K - 1])
  return Derived(plan, tuple(delays), tuple(rings), tuple(first_f), tuple(first_b), fill)


# ------------------------------------------------------------------------------ the plans
def bp(num_stages: int) -> Plan:
  """BP: the whole forward, then the whole backward of the tick's batch."""
  K = num_stages
  calls = [Call(0, True, False, "batch", None)] if K > 1 else []
  calls += [Call(k, True, False, "now", None) for k in range(1, K - 1)]
  calls += [Call(K - 1, True, True, "batch" if K == 1 else "now", None)]
  calls += [Call(k, False, True, None, "now") for k in reversed(range(K - 1))]
  return Plan("bp", K, tuple(calls))


def ddg(num_stages: int) -> Plan:
  """DDG: the whole forward of the tick's batch; each stage's backward uses the cotangent
  sent at the previous tick (Huo et al. 2018)."""
  K = num_stages
  calls = [Call(0, True, False, "batch", None)] if K > 1 else []
  calls += [Call(k, True, False, "now", None) for k in range(1, K - 1)]
  calls += [Call(K - 1, True, True, "batch" if K == 1 else "now", None)]
  calls += [Call(k, False, True, None, "inbox") for k in reversed(range(K - 1))]
  return Plan("ddg", K, tuple(calls))


def fdg(num_stages: int) -> Plan:
  """FDG: every stage reads only messages of the previous tick: its delayed backward, its
  update, then its forward (Zhuang et al. 2021)."""
  K = num_stages
  calls = [Call(k, True, True, "batch" if k == 0 else "inbox", "inbox")
           for k in range(K - 1)]
  calls += [Call(K - 1, True, True, "batch" if K == 1 else "inbox", None)]
  return Plan("fdg", K, tuple(calls))


_PLAN_CACHE: dict = {}


def plan(name: str, num_stages: int) -> Plan:
  """The plan of the registered schedule `name` for `num_stages` stages (a value: built once
  per name and K, anew after a `register`)."""
  key = (name, num_stages)
  if key not in _PLAN_CACHE:
    sp = spec(name)
    if sp.make_plan is None:
      raise ValueError(f"{name!r} is a pipeline of micro-batches, not a tick plan: see "
                       "microbatch_order")
    made = sp.make_plan(num_stages)
    if not isinstance(made, Plan):
      raise TypeError(f"schedule {name!r}'s make_plan returned {type(made).__name__}, not a "
                      "plans.Plan")
    _PLAN_CACHE[key] = made
  return _PLAN_CACHE[key]


# ------------------------------------------------------------------------------ micro-batches
def microbatch_order(name: str, num_stages: int, microbatches: int) -> list[list[tuple]]:
  """Per stage (device), the order of its micro-batch actions in a tick of the registered
  synchronous pipeline `name`: ("F", m) and ("B", m); every stage updates once after its
  last action (gpipe: `gpipe_order`, 1f1b: `one_f_one_b_order`)."""
  sp = spec(name)
  if sp.make_order is None:
    raise ValueError(f"no micro-batch plan named {name!r}; known: "
                     f"{', '.join(names(microbatched=True))}")
  if microbatches < 1:
    raise ValueError(f"microbatches must be >= 1, got {microbatches}")
  return sp.make_order(num_stages, microbatches)


def gpipe_order(num_stages: int, microbatches: int) -> list[list[tuple]]:
  """GPipe (Huang et al. 2019): F0 .. F(M-1), then B(M-1) .. B0 on every stage."""
  M = microbatches
  return [[("F", m) for m in range(M)] + [("B", m) for m in reversed(range(M))]
          for _ in range(num_stages)]


def one_f_one_b_order(num_stages: int, microbatches: int) -> list[list[tuple]]:
  """1F1B (PipeDream-Flush, Narayanan et al. 2021): min(M, K-1-k) warm-up forwards, then one
  forward and one backward in turn, then the remaining backwards."""
  K, M = num_stages, microbatches
  out = []
  for k in range(K):
    warm = min(M, K - 1 - k)
    order = [("F", m) for m in range(warm)]
    f, b = warm, 0
    while f < M:
      order += [("F", f), ("B", b)]
      f, b = f + 1, b + 1
    order += [("B", m) for m in range(b, M)]
    out.append(order)
  return out


# ------------------------------------------------------------------------------ the registry
OPTIONS = ("beta", "shrink_at", "backward", "microbatches")  # what a schedule may accept
ENGINES = ("fused", "per_stage", "spmd")


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
  """A schedule as the library knows it: everything that depends on its name is read here.

  make_plan: `make_plan(num_stages, **options) -> Plan` (a schedule of ticks, run by
    `fdg_jax.Schedule`); None for a pipeline of micro-batches.
  make_order: `make_order(num_stages, microbatches)`, the per-stage micro-batch actions of a
    synchronous pipeline (run by `fdg_jax.SyncPipeline`); None for a tick plan.
  delayed: its gradients are stale (the staleness remedies and `staleness=auto` apply).
  options: the keyword options it takes, of OPTIONS.
  engines: the engines that run it, of ENGINES.
  replicas: whether it runs as data-parallel replicas (DP x the schedule).
  """
  name: str
  make_plan: Optional[Callable] = None
  make_order: Optional[Callable] = None
  delayed: bool = True
  options: tuple = ("backward",)
  engines: tuple = ("fused", "per_stage")
  replicas: bool = True
  description: str = ""

  @property
  def microbatched(self) -> bool:
    return self.make_order is not None


_REGISTRY: dict[str, ScheduleSpec] = {}


def register(name: str, make_plan: Optional[Callable] = None, *, replace: bool = False,
             **spec) -> ScheduleSpec:
  """Declares a schedule by name, so that `fdg_jax.create(name, ...)`, `train.py
  --config.algorithm=name` (with `--config.plan_module` naming the module that registers
  it) and the benchmarks run it like a built-in.

  `make_plan(num_stages, **options)` returns its `Plan`; or pass `make_order=` for a
  synchronous pipeline of micro-batches. The other keywords are `ScheduleSpec`'s fields
  (delayed, options, engines, replicas, description). Returns the spec.
  """
  if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
    raise ValueError(f"a schedule's name must be a plain word, got {name!r}")
  if name in _REGISTRY and not replace:
    raise ValueError(f"a schedule named {name!r} is registered already (replace=True to "
                     "redefine it)")
  sp = ScheduleSpec(name, make_plan, **spec)
  if (sp.make_plan is None) == (sp.make_order is None):
    raise ValueError(f"schedule {name!r}: give exactly one of make_plan (a tick plan) and "
                     "make_order (micro-batch actions)")
  bad = [o for o in sp.options if o not in OPTIONS] + [e for e in sp.engines
                                                       if e not in ENGINES]
  if bad:
    raise ValueError(f"schedule {name!r}: unknown option(s) or engine(s) {bad}; options "
                     f"are {OPTIONS}, engines {ENGINES}")
  _REGISTRY[name] = sp
  _PLAN_CACHE.clear()
  return sp


def spec(name: str) -> ScheduleSpec:
  """The registered schedule `name` (ValueError naming the known ones)."""
  try:
    return _REGISTRY[name]
  except (KeyError, TypeError):
    raise ValueError(f"no schedule named {name!r}; known: {', '.join(names())}") from None


def names(*, microbatched: Optional[bool] = None, delayed: Optional[bool] = None) -> tuple:
  """The registered schedules' names, in registration order, optionally filtered."""
  return tuple(n for n, s in _REGISTRY.items()
               if (microbatched is None or s.microbatched == microbatched)
               and (delayed is None or s.delayed == delayed))


register("bp", lambda num_stages: bp(num_stages), delayed=False, options=("backward",),
         description="backpropagation: the whole forward, then the whole backward")
register("ddg", lambda num_stages: ddg(num_stages), options=("backward",),
         description="decoupled backward, delay K-1-k (Huo et al. 2018)")
register("fdg", lambda num_stages: fdg(num_stages), options=("beta", "shrink_at", "backward"),
         engines=ENGINES, description="forward, backward and update decoupled, delay "
                                      "2(K-1-k), gradient shrinking (Zhuang et al. 2021)")
register("gpipe", make_order=gpipe_order, delayed=False, options=("microbatches",),
         replicas=False, description="synchronous pipeline, all forwards then all backwards")
register("1f1b", make_order=one_f_one_b_order, delayed=False, options=("microbatches",),
         replicas=False, description="synchronous pipeline, one forward one backward")


def peak_stash(order: list[tuple]) -> int:
  """The most micro-batches a stage holds stashed at once under its action `order`."""
  held = peak = 0
  for kind, _ in order:
    held += 1 if kind == "F" else -1
    peak = max(peak, held)
  return peak


def global_order(orders: list[list[tuple]]) -> list[tuple]:
  """One order of all stages' actions that respects every dependency (F(k, m) after
  F(k-1, m), B(k, m) after B(k+1, m) and after F(k, m)) and each stage's own order: the
  stages' lists merged by a list scheduler that issues, round after round, every stage's
  next action whose inputs are ready. Returns [(stage, kind, m)]."""
  K = len(orders)
  pos = [0] * K
  done = set()
  out = []
  while any(pos[k] < len(orders[k]) for k in range(K)):
    progressed = False
    for k in range(K):
      if pos[k] >= len(orders[k]):
        continue
      kind, m = orders[k][pos[k]]
      if kind == "F":
        ready = k == 0 or ("F", k - 1, m) in done
      else:
        ready = ("F", k, m) in done and (k == K - 1 or ("B", k + 1, m) in done)
      if ready:
        out.append((k, kind, m))
        done.add((kind, k, m))
        pos[k] += 1
        progressed = True
    if not progressed:
      raise ValueError("the per-stage orders deadlock: no stage's next action is ready")
  return out
