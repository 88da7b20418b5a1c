"""What a plan implies: whether it can run (`validate`) and, from running its messages over
ticks with batch indices, each stage's delay, ring size, first forward and backward ticks
and the pipeline's fill (`derive`, `Derived`). `fdg_jax.plans.Plan` calls these; they read
only a plan's calls (`plans.Call`), never an engine or a model."""

from __future__ import annotations

import dataclasses
from typing import Any

Plan = Any  # fdg_jax.plans.Plan (not imported: plans imports this module)


def validate(plan: Plan) -> None:
  """One clear ValueError for a plan that cannot run: calls out of range, a stage whose
  forwards and backwards are missing, a message read "now" before it is sent."""
  K = plan.num_stages
  if K < 1:
    raise ValueError(f"a plan needs at least one stage, got {K}")
  if not plan.calls:
    raise ValueError(f"{plan.name}: a plan needs calls")
  seen_f, seen_b, sent = set(), set(), set()
  summing, summed = set(), set()  # stages that accumulate; those whose sum was applied
  for i, c in enumerate(plan.calls):
    if not 0 <= c.stage < K:
      raise ValueError(f"{plan.name}: call {i} is on stage {c.stage} of {K}")
    if c.micro < 0:
      raise ValueError(f"{plan.name}: call {i} has micro-batch {c.micro} < 0")
    if c.applies_sum:
      if not c.update or c.act is not None or c.cot is not None:
        raise ValueError(f"{plan.name}: call {i} does neither forward nor backward: it must "
                         "be an update call (update=True, no sources)")
      if c.stage not in summing or c.stage in summed:
        raise ValueError(f"{plan.name}: call {i} applies stage {c.stage}'s gradient sum, "
                         "but the stage has no accumulated backward before it (or applied "
                         "it already this tick)")
      summed.add(c.stage)
      continue
    if c.backward and not c.update:
      if c.stage in summed:
        raise ValueError(f"{plan.name}: call {i} accumulates into stage {c.stage}'s sum "
                         "after it was applied this tick")
      summing.add(c.stage)
    last = c.stage == K - 1
    if last and not (c.forward and c.backward and c.cot is None):
      raise ValueError(f"{plan.name}: the last stage's call does its loss, gradient and "
                       f"update (forward=backward=True, cot=None), not {c}")
    if c.forward:
      if c.act is None:
        raise ValueError(f"{plan.name}: call {i} forwards with no activation source")
      if (c.act == "batch") != (c.stage == 0):
        raise ValueError(f"{plan.name}: call {i}: only stage 0 reads the batch")
      if c.act == "now" and ("act", c.stage, c.micro) not in sent:
        raise ValueError(f"{plan.name}: call {i} reads stage {c.stage - 1}'s activation of "
                         "this tick before it is sent")
      seen_f.add(c.stage)
      if c.stage < K - 1:
        sent.add(("act", c.stage + 1, c.micro))
    if c.backward and not last:
      if c.cot is None:
        raise ValueError(f"{plan.name}: call {i} backwards with no cotangent source")
      if c.cot == "now" and ("cot", c.stage, c.micro) not in sent:
        raise ValueError(f"{plan.name}: call {i} reads stage {c.stage + 1}'s cotangent of "
                         "this tick before it is sent")
      seen_b.add(c.stage)
    if c.backward and c.stage > 0:
      sent.add(("cot", c.stage - 1, c.micro))
  missing = [k for k in range(K) if k not in seen_f or (k < K - 1 and k not in seen_b)]
  if missing:
    raise ValueError(f"{plan.name}: stages {missing} never forward or never backward")
  if summing != summed:
    raise ValueError(f"{plan.name}: stages {sorted(summing - summed)} accumulate gradients "
                     "that no update call applies within the tick")
  applying = {c.stage for c in plan.calls if c.backward and c.update}
  if summing & applying:
    raise ValueError(f"{plan.name}: stages {sorted(summing & applying)} both accumulate and "
                     "apply gradients at once: a stage does one or the other")
  M = 1 + max(c.micro for c in plan.calls)
  if summing:
    for k in range(K):
      micros = sorted(c.micro for c in plan.calls if c.stage == k and c.forward)
      if micros != list(range(M)):
        raise ValueError(f"{plan.name}: stage {k} forwards micro-batches {micros}; a "
                         f"synchronous plan forwards each of its {M} once a tick")
  elif M > 1:
    raise ValueError(f"{plan.name}: a plan over micro-batches must accumulate their "
                     "gradients (update=False) and apply the sum with an update call")


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
  the most stash entries each stage held at once). A batch is its tick t, or (t, m) for
  micro-batch m of a plan that splits the batch."""
  K, M = plan.num_stages, plan.microbatches
  ident = (lambda t, m: t) if M == 1 else (lambda t, m: (t, m))
  inbox_act, inbox_cot = {}, {}  # (receiving stage, micro-batch) -> batch
  stash = [[] for _ in range(K)]
  peak = [0] * K
  events = []
  for t in range(ticks):
    now_act, now_cot, next_act, next_cot = {}, {}, {}, {}
    for c in plan.calls:
      if c.applies_sum:
        continue
      k, key = c.stage, (c.stage, c.micro)
      reads = lambda src, now, inbox: (now.get(key) if src == "now" else inbox.get(key))
      if k == K - 1:
        b = ident(t, c.micro) if c.act == "batch" else reads(c.act, now_act, inbox_act)
        if b is None:
          continue
        events += [(t, k, "F", b), (t, k, "B", b)]
        if k > 0:
          (now_cot if _reader_reads_now(plan, k - 1) else next_cot)[(k - 1, c.micro)] = b
        continue
      if c.backward:
        b = reads(c.cot, now_cot, inbox_cot)
        if b is not None and stash[k]:
          got = plan.kind.take_stash(stash[k], b)
          assert got == b, (plan.name, t, k, got, b)
          events.append((t, k, "B", b))
          if k > 0:
            (now_cot if _reader_reads_now(plan, k - 1) else next_cot)[(k - 1, c.micro)] = b
      if c.forward:
        b = ident(t, c.micro) if c.act == "batch" else reads(c.act, now_act, inbox_act)
        if b is not None:
          stash[k].append(b)
          peak[k] = max(peak[k], len(stash[k]))
          events.append((t, k, "F", b))
          (now_act if _act_read_now(plan, k + 1) else next_act)[(k + 1, c.micro)] = b
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
