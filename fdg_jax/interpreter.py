"""The interpreter of a plan: one tick's calls, in the plan's order, run by an engine's ops.

`run_tick` is the only tick body of the library. It walks the calls a plan issues at tick t
(`plans.Plan.issued`), asks the engine's ops object how to run each (`ops.call(k, f, b)`:
a stage's work traced into the caller's program, or a jitted call on the stage's devices),
and moves the messages between them: a message the plan reads in the same tick goes to its
receiver at once (`ops.move`: a call of the per-stage engine then leaves as soon as its
input is there), the messages read at tick t+1 move together at the end of the tick, in one
batched copy (`ops.move_all`), into the inbox.

A plan that accumulates (GPipe, 1F1B) splits the batch into micro-batches: each forward's
stash entry and each stage's gradient sum live within the tick (`ops.forward_micro`,
`ops.backward_micro`, `ops.last_micro`), and its update calls apply the sums
(`ops.apply_sum`); its loss is the sum of the micro-batch means and its metrics are those of
the whole batch.

The ops protocol (`engines.fused.FusedOps`, `engines.fused.GatedOps`,
`engines.per_stage.PerStageOps`): `old_messages_first` (the issue order), `begin_tick()`,
`call(k, do_fwd, do_bwd)`, `move(k, tree)`, `move_all([(k, tree)])` and the four micro-batch
pieces above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fdg_jax.ring import select


def run_tick(plan, math, ops, stages, inbox, batch, t):
  """One tick of `plan` (see the module docstring).

  Args:
    plan: the `plans.Plan`.
    math: the schedule's `stage_math.StageMath` (micro-batch slicing, metrics).
    ops: the engine's ops object.
    stages: the K stage states as `ops` takes them (packed per stage, or unpacked).
    inbox: the messages sent at tick t-1 (None for a plan that accumulates).
    batch: b_t = (x_t, y_t) on stage 0.
    t: the tick (host int, traced int, or None past the fill); see `plans.Plan.flags`.
  Returns:
    (stages, inbox for tick t+1, updated (K entries: batch index, masked, or None),
     metrics of the batch that reached the loss ({} if none), whether one did).
  """
  K = plan.num_stages
  stages = list(stages)
  # unsent messages keep their placeholders (a plan that accumulates has no inbox)
  new_inbox = None if inbox is None else [dict(box) for box in inbox]
  updated: list = [None] * K
  metrics: dict = {}
  active = plan.flags(K - 1, t)[0]
  ops.begin_tick()
  now = {"act": {}, "cot": {}}  # messages sent earlier in this tick, by (receiver, micro)
  outgoing = []  # (receiving stage, "act" | "cot", flag, message), read at tick t+1
  # A plan that accumulates: each stage's stash entries and gradient sum of this tick, the
  # last stage's losses and outputs, the labels where the last stage reads them.
  held, sums, losses, outs = {}, [None] * K, [], {}
  tick_kind = plan.kind
  tick, firsts, labels = tick_kind.tick_inputs(plan, math, ops, batch, t)

  def send(k, kind, flag, message, m=0):
    if plan.reads_now(k, kind):
      now[kind][(k, m)] = ops.move(k, message)
    else:
      outgoing.append((k, kind, flag, message))

  def source(k, kind, where, m=0):
    if where == "batch":
      return tick_kind.input_of(firsts, batch, m)
    return now[kind].pop((k, m)) if where == "now" else inbox[k][kind]

  # The engine may issue the calls that read only messages of tick t-1 in any order among
  # themselves; `GatedOps` reverses them, so that each message of tick t-1 is read before
  # the one replacing it is made.
  for call, do_fwd, do_bwd in plan.issued(t, ops.old_messages_first):
    k, m = call.stage, call.micro
    if call.applies_sum:  # the update call: the stage applies the tick's gradient sum
      stages[k] = ops.apply_sum(k)(stages[k], sums[k])
      updated[k] = t
      continue
    if not call.update:  # micro-batch m's forward or backward, its gradient summed
      if k == K - 1:  # its loss, gradient and cotangent at once
        ms, g, gx, loss, out = ops.last_micro()(
            stages[k], source(k, "act", call.act, m), math.micro(labels, m), tick, m)
        sums[k] = g if sums[k] is None else jax.tree.map(jnp.add, sums[k], g)
        losses.append(loss)
        outs[m] = out
      elif call.forward:
        ms, h, held[(k, m)] = ops.forward_micro(k)(
            stages[k], source(k, "act", call.act, m), tick, m)
        gx = None
        send(k + 1, "act", True, h, m)
      else:
        ms = None
        sums[k], gx = ops.backward_micro(k)(held.pop((k, m)),
                                             source(k, "cot", call.cot, m), sums[k])
      if ms is not None:
        stages[k] = {**stages[k], "model_state": ms}
      if gx is not None:
        send(k - 1, "cot", True, gx, m)
      continue
    act = source(k, "act", call.act) if do_fwd is not False else None
    cot = source(k, "cot", call.cot) if do_bwd is not False and call.cot else None
    stages[k], act_out, cot_out, upd, met = ops.call(k, do_fwd, do_bwd)(stages[k], act, cot)
    if do_bwd is not False:
      updated[k] = upd
    if met:
      metrics = met
    if act_out is not None:
      send(k + 1, "act", do_fwd, act_out)
    if cot_out is not None:
      send(k - 1, "cot", do_bwd, cot_out)
  if outgoing:
    moved = ops.move_all([(k, msg) for k, _, _, msg in outgoing])
    for (k, kind, flag, _), msg in zip(outgoing, moved):
      new_inbox[k][kind] = select(flag, msg, inbox[k][kind])
  if losses:  # the batch's loss: the sum of the micro-batch means; metrics on all of it
    out = jnp.concatenate([outs[m] for m in range(plan.microbatches)])
    metrics = {"loss": sum(losses), **math.metrics_fn(out, labels)}
  return stages, new_inbox, updated, metrics, active
