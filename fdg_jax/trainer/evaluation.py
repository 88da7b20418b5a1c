"""Evaluation of a schedule's state: test-set metrics, and where it stopped being finite.

`evaluate` runs the synchronous eval forward over a test iterator and computes the metrics
in float64 on the host (every process computes those of the whole test set). The finiteness
checks say which stage's parameters, optimiser state or messages hold a NaN or infinity,
for the training loop's divergence errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fdg_jax.runtime import arrays as runtime_arrays


def evaluate(schedule, state, iterator, keys=("image", "label")) -> dict:
  """Eval-mode loss and accuracy over one pass of `iterator` (padded rows masked out).

  Labels may carry extra axes (a language model's [B, T] targets): every position counts,
  and the loss is the mean per position (tokens), with `test_perplexity` = exp(loss).
  `test_loss_se`: the standard error of the mean loss over the examples (a sequence counts
  once, its loss the mean over its tokens), for choosing between runs on held-out data.
  With several processes every process reads whole test batches and feeds stage 0 its
  rows of them; the logits are fetched to every process, so that each computes the
  metrics of the whole test set.
  """
  total_loss = correct = count = 0.0
  rows = row_sum = row_sq = 0.0  # per example (a sequence: its mean per token) losses
  per_token = False
  for batch in iterator:
    x = batch[keys[0]]
    logits = runtime_arrays.fetch(schedule.evaluate(state, x[_fed_rows(schedule, len(x))]))
    labels = np.asarray(batch[keys[1]])
    mask = batch.get("mask", np.ones(len(labels), np.float32))
    per_token = labels.ndim > 1
    mask = np.broadcast_to(np.asarray(mask, np.float64).reshape(
        (-1,) + (1,) * (labels.ndim - 1)), labels.shape).reshape(-1)
    logits = np.asarray(logits, np.float64).reshape(labels.size, -1)
    labels = labels.reshape(-1)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - logits[np.arange(len(labels)), labels]
    total_loss += float((nll * mask).sum())
    per_row = nll.reshape(len(batch[keys[1]]), -1).mean(-1)
    real = np.asarray(batch.get("mask", np.ones(len(per_row))), np.float64)
    rows += float(real.sum())
    row_sum += float((per_row * real).sum())
    row_sq += float((per_row ** 2 * real).sum())
    correct += float(((logits.argmax(-1) == labels) * mask).sum())
    count += float(mask.sum())
  out = {"test_loss": total_loss / max(count, 1), "test_accuracy": correct / max(count, 1)}
  if rows > 1:  # the standard error of the mean loss over examples (sequences)
    mean = row_sum / rows
    out["test_loss_se"] = float(np.sqrt(max(row_sq / rows - mean ** 2, 0.0) / (rows - 1)))
  if per_token:
    out["test_perplexity"] = float(np.exp(out["test_loss"]))
  return out


def _fed_rows(schedule, batch_size: int) -> slice:
  """The rows of a whole batch this process passes to the schedule (all if it feeds none:
  they give the shapes only)."""
  placement = schedule.placement
  if placement.feeder() is None:
    return slice(None)
  return placement.local_batch_slice(batch_size)


_FINITE = jax.jit(lambda tree: jnp.all(jnp.stack(
    [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)
     if jnp.issubdtype(a.dtype, jnp.inexact)] + [jnp.bool_(True)])))


def _finite_flags(trees) -> list[bool]:
  """Whether each tree's floating arrays are all finite (each tree on one stage's devices);
  one host read for all of them."""
  return [bool(f) for f in runtime_arrays.fetch([_FINITE(t) for t in trees])]


def nonfinite_stage(schedule, state) -> int | None:
  """The first stage whose parameters hold a NaN or infinity, or None."""
  flags = _finite_flags(schedule.params(state))
  return next((k for k, ok in enumerate(flags) if not ok), None)


def nonfinite_part(schedule, state) -> str | None:
  """Which part of the schedule state is not finite (parameters first), or None."""
  k = nonfinite_stage(schedule, state)
  if k is not None:
    return f"stage {k}'s parameters"
  boxes = [box for box in (state.get("inbox") or []) if jax.tree.leaves(box)]
  flags = _finite_flags(list(state["stages"]) + boxes)
  K = len(state["stages"])
  k = next((k for k, ok in enumerate(flags[:K]) if not ok), None)
  if k is not None:
    return f"stage {k}'s optimizer state or stash"
  if not all(flags[K:]):
    return "a message between stages"
  return None
