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
`spec`, `names`): its plan factory and what it accepts (options, replicas, whether its
gradients are delayed); which engines run its plan, the engines say. Everything else that
depends on a schedule's name reads it.

A plan may split the tick's batch into M equal **micro-batches** (`Call.micro`): GPipe and
1F1B, the synchronous pipelines, are plans of this kind, built from each device's order of
micro-batch actions (`microbatch_order`): a forward of micro-batch m, its backward with the
gradient accumulated (`Call.update` False), and after the tick's last backward one update
call per stage (forward = backward = False), which applies the sum, as
torch.distributed.pipelining's REDUCE_GRAD does. A plan that accumulates keeps its stash
within the tick (nothing but parameters and optimizer states is carried between ticks).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Optional

from fdg_jax.dataflow import Derived, derive, validate

SOURCES = ("batch", "now", "inbox")


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a stage in a tick: its backward and/or forward (see the module docstring).

  For the last stage, forward = backward = True (loss, gradient, update) and cot is None.
  `micro`: the micro-batch the call works on (0 where the plan does not split the batch).
  `update`: whether the backward applies its gradient at once (True) or adds it to the
  tick's sum (False); a call with neither forward nor backward applies that sum (an update
  call)."""
  stage: int
  forward: bool
  backward: bool
  act: Optional[str]   # where the forward's activation comes from (None: no forward)
  cot: Optional[str]   # where the backward's cotangent comes from (None: no backward / last)
  micro: int = 0
  update: bool = True

  def __post_init__(self):
    for name in ("act", "cot"):
      v = getattr(self, name)
      if v is not None and v not in SOURCES:
        raise ValueError(f"Call.{name} must be one of {SOURCES} or None, got {v!r}")

  @property
  def applies_sum(self) -> bool:
    """Whether this is an update call: it applies the gradients the stage accumulated."""
    return not self.forward and not self.backward


@dataclasses.dataclass(frozen=True)
class Plan:
  """The calls of one tick, in order, for K stages (a tuple of `Call`; see the module
  docstring). `orders`: for a plan built from each device's order of micro-batch actions
  (`synchronous`), those orders, [("F" | "B", m), ...] per stage; None otherwise."""
  name: str
  num_stages: int
  calls: tuple
  orders: Optional[tuple] = None

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
    """Stash entries each stage holds at its peak: the ring of a plan that carries its stash
    across ticks; for a plan built from micro-batch orders, each order's peak
    (`peak_stash`)."""
    if self.orders is not None:
      return tuple(peak_stash(o) for o in self.orders)
    return self.derived.ring_sizes

  @property
  def fill_ticks(self) -> int:
    return self.derived.fill_ticks

  @property
  def microbatches(self) -> int:
    """M: the equal parts the tick's batch is split into (1: the whole batch)."""
    return 1 + max(c.micro for c in self.calls)

  @property
  def accumulates(self) -> bool:
    """Whether the stages sum their micro-batch gradients and apply the sum once a tick (a
    synchronous pipeline): its stash lives within the tick, not in a ring of the state."""
    return any(c.applies_sum for c in self.calls)

  @property
  def kind(self):
    """The plan's kind of tick (`fdg_jax.tick_kinds`), chosen here once (again only after a
    `tick_kinds.register`): synchronous where the stages apply a gradient sum, else
    delayed. Everything that differs between kinds asks it."""
    from fdg_jax import tick_kinds
    cached = self.__dict__.get("_kind")
    if cached is None or cached[0] != tick_kinds.generation():
      cached = (tick_kinds.generation(), tick_kinds.of(self))
      object.__setattr__(self, "_kind", cached)  # a frozen dataclass's cache
    return cached[1]

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
      if call.applies_sum:  # a plan that accumulates has no fill: every tick the same
        out.append((call, False, False))
        continue
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
    are then independent, and can run as one SPMD program. A plan that accumulates is not:
    its update calls wait for the tick's every backward."""
    return not self.accumulates and all("now" not in (c.act, c.cot) for c in self.calls)

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
        name = lambda x: f"{x[0]}.{x[1]}" if isinstance(x, tuple) else str(x)
        cells.append(" ".join([f"F{name(x)}" for x in f] + [f"B{name(x)}" for x in b]) or ".")
      rows.append(f"{t:4d} | " + " | ".join(f"{c:7s}" for c in cells))
    return "\n".join(rows)


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


def pipedream(num_stages: int) -> Plan:
  """PipeDream (Narayanan et al., SOSP 2019), asynchronous with weight stashing: the forward
  is pipelined (stage k forwards batch t-k at tick t, reading what stage k-1 sent at the
  previous tick) and the backward of the batch that reached the last stage runs down the
  stages within the tick, each stage then updating; stage k's gradient is K-1-k updates
  stale, computed at the weights its forward ran with, and the stages' weights behind one
  gradient are of different versions, PipeDream's update
  W(t+1) = W(t) - lr * grad f(W_0(t-K+1), ..., W_{K-1}(t))."""
  K = num_stages
  calls = [Call(K - 1, True, True, "batch" if K == 1 else "inbox", None)]
  calls += [Call(k, True, True, "batch" if k == 0 else "inbox", "now")
            for k in reversed(range(K - 1))]
  return Plan("pipedream", K, tuple(calls))


def synchronous(name: str, orders: list[list[tuple]]) -> Plan:
  """The plan of a synchronous pipeline from each stage's order of micro-batch actions
  [("F" | "B", m), ...]: the actions in one order that keeps every stage's own
  (`global_order`), every backward accumulating its gradient, the last stage's loss and
  gradient at its forward, then one update call per stage."""
  K = len(orders)
  calls = []
  for k, kind, m in global_order(orders):
    if kind == "F":
      calls.append(Call(k, True, k == K - 1, "batch" if k == 0 else "now", None, micro=m,
                        update=False))
    elif k < K - 1:
      calls.append(Call(k, False, True, None, "now", micro=m, update=False))
  calls += [Call(k, False, False, None, None) for k in range(K)]
  return Plan(name, K, tuple(calls), tuple(tuple(o) for o in orders))


def gpipe(num_stages: int, microbatches: int = 1) -> Plan:
  """GPipe (Huang et al. 2019): every stage forwards its M micro-batches, then runs their
  backwards in reverse, accumulating; one update per stage at the end of the tick."""
  return synchronous("gpipe", gpipe_order(num_stages, microbatches))


def one_f_one_b(num_stages: int, microbatches: int = 1) -> Plan:
  """1F1B (PipeDream-Flush, Narayanan et al. 2021): min(M, K-1-k) warm-up forwards, then one
  forward and one backward in turn; one update per stage at the end of the tick."""
  return synchronous("1f1b", one_f_one_b_order(num_stages, microbatches))


_PLAN_CACHE: dict = {}


def plan(name: str, num_stages: int, **options) -> Plan:
  """The plan of the registered schedule `name` for `num_stages` stages and its plan options
  (`microbatches=M` for a pipeline of micro-batches): a value, built once per name, K and
  options, anew after a `register`."""
  sp = spec(name)
  options = {k: v for k, v in options.items() if k in PLAN_OPTIONS and k in sp.options}
  key = (name, num_stages, tuple(sorted(options.items())))
  if key not in _PLAN_CACHE:
    if sp.microbatched and int(options.get("microbatches", 1)) < 1:
      raise ValueError(f"microbatches must be >= 1, got {options.get('microbatches')}")
    made = sp.make_plan(num_stages, **options)
    if not isinstance(made, Plan):
      raise TypeError(f"schedule {name!r}'s make_plan returned {type(made).__name__}, not a "
                      "plans.Plan")
    _PLAN_CACHE[key] = made
  return _PLAN_CACHE[key]


# ------------------------------------------------------------------------------ micro-batches
def microbatch_order(name: str, num_stages: int, microbatches: int) -> list[list[tuple]]:
  """Per stage (device), the order of its micro-batch actions in a tick of the registered
  synchronous pipeline `name`: ("F", m) and ("B", m); every stage updates once after its
  last action (the orders its plan was built from)."""
  sp = spec(name)
  if not sp.microbatched:
    raise ValueError(f"no micro-batch plan named {name!r}; known: "
                     f"{', '.join(names(microbatched=True))}")
  if microbatches < 1:
    raise ValueError(f"microbatches must be >= 1, got {microbatches}")
  return [list(o) for o in plan(name, num_stages, microbatches=microbatches).orders]


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
PLAN_OPTIONS = ("microbatches",)  # those that change the plan (make_plan's keywords)


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
  """A schedule as the library knows it: everything that depends on its name is read here.

  Fields:

  - ``make_plan``: ``make_plan(num_stages, **plan_options) -> Plan``, where the plan options
    are those of ``options`` in PLAN_OPTIONS (e.g. microbatches).
  - ``delayed``: its gradients are stale (the staleness remedies and ``staleness=auto`` apply).
  - ``options``: the keyword options it takes, of OPTIONS.
  - ``replicas``: whether it runs as data-parallel replicas (DP x the schedule).
  """
  name: str
  make_plan: Callable
  delayed: bool = True
  options: tuple = ("backward",)
  replicas: bool = True
  description: str = ""

  @property
  def microbatched(self) -> bool:
    """Whether it splits the batch into micro-batches (it takes `microbatches`)."""
    return "microbatches" in self.options


_REGISTRY: dict[str, ScheduleSpec] = {}


def register(name: str, make_plan: Callable, *, replace: bool = False, **spec) -> ScheduleSpec:
  """Declares a schedule by name, so that `fdg_jax.create(name, ...)`, `train.py
  --config.algorithm=name` (with `--config.plan_module` naming the module that registers
  it) and the benchmarks run it like a built-in.

  `make_plan(num_stages, **plan_options)` returns its `Plan`. The other keywords are
  `ScheduleSpec`'s fields (delayed, options, replicas, description); which engines run it
  each engine says (`fdg_jax.engines`). Returns the spec.
  """
  if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
    raise ValueError(f"a schedule's name must be a plain word, got {name!r}")
  if name in _REGISTRY and not replace:
    raise ValueError(f"a schedule named {name!r} is registered already (replace=True to "
                     "redefine it)")
  if not callable(make_plan):
    raise ValueError(f"schedule {name!r}: make_plan must be a function of (num_stages, "
                     "**options) returning a plans.Plan")
  sp = ScheduleSpec(name, make_plan, **spec)
  bad = [o for o in sp.options if o not in OPTIONS]
  if bad:
    raise ValueError(f"schedule {name!r}: unknown option(s) {bad}; options are {OPTIONS}")
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


register("bp", bp, delayed=False, options=("backward",),
         description="backpropagation: the whole forward, then the whole backward")
register("ddg", ddg, options=("backward",),
         description="decoupled backward, delay K-1-k (Huo et al. 2018)")
register("fdg", fdg, options=("beta", "shrink_at", "backward"),
         description="forward, backward and update decoupled, delay 2(K-1-k), gradient "
                     "shrinking (Zhuang et al. 2021)")
register("gpipe", gpipe, delayed=False, options=("microbatches",), replicas=False,
         description="synchronous pipeline, all forwards then all backwards")
register("1f1b", one_f_one_b, delayed=False, options=("microbatches",), replicas=False,
         description="synchronous pipeline, one forward one backward")
register("pipedream", pipedream,
         description="PipeDream: pipelined forward, backward down the stages in the tick, "
                     "weight stashing (Narayanan et al. 2019)")


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
