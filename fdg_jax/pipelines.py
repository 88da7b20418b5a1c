"""GPipe and 1F1B: synchronous pipelines over K stages, as plans that accumulate.

Each tick's batch b_t (B examples) is split into M contiguous micro-batches of B/M. Every
stage runs the forwards and backwards of its micro-batches in its device's order
(`plans.microbatch_order`: GPipe all forwards then all backwards, 1F1B one forward one
backward after min(M, K-1-k) warm-up forwards), sums its gradients, and updates once at the
end of the tick. The loss is the mean over the whole batch (the mean of the M micro-batch
means), so after every tick the parameters are BP's on b_t up to float reduction order;
there is no delay and no state carried between ticks but parameters, optimizer and model
states. BatchNorm sees each micro-batch alone (its statistics are the micro-batch's, updated
M times per tick), so with BatchNorm the result is BP's on micro-batches.

Their plans (`plans.gpipe`, `plans.one_f_one_b`) are plans like BP's, DDG's and FDG's, and
`fdg_jax.Schedule` runs them with the same interpreter and engines:

- fused (every stage on one device): one program per tick, every micro-batch action traced
  in the plan's order; the vjp residuals stay inside the program;
- per-stage (a device per stage): each action is a jitted call on its stage's device, issued
  in the plan's order, which respects every device's own order and every dependency
  (`plans.global_order`), so that with asynchronous dispatch the K devices overlap as the
  schedule intends; a forward returns its vjp residuals, which the host holds until the
  stage's backward (at most `peak_stash` micro-batches at once: M for GPipe, min(M, K-k)
  for 1F1B).

SPMD programs and data-parallel meshes are not offered for these plans (refused in one line).
"""

from __future__ import annotations

from fdg_jax import plans as plans_lib
from fdg_jax.schedules import Schedule

SYNC_PLANS = plans_lib.names(microbatched=True)  # the built-in ones (gpipe, 1f1b)


class SyncPipeline(Schedule):
  """A `Schedule` of a registered synchronous pipeline (GPipe, 1F1B, or one of the user's),
  by name, with `microbatches=M`."""

  def __init__(self, name: str, stages, loss_fn, optimizer, *, microbatches: int, **kwargs):
    if name not in plans_lib.names(microbatched=True):
      raise ValueError(f"unknown synchronous pipeline {name!r}; choose one of "
                       f"{plans_lib.names(microbatched=True)}")
    super().__init__(name, stages, loss_fn, optimizer, microbatches=microbatches, **kwargs)


def gpipe(stages, loss_fn, optimizer, *, microbatches: int, **kwargs) -> SyncPipeline:
  """GPipe (Huang et al. 2019): all M micro-batch forwards, then all backwards; one update
  per stage per tick, BP's update (see the module docstring)."""
  return SyncPipeline("gpipe", stages, loss_fn, optimizer, microbatches=microbatches, **kwargs)


def one_f_one_b(stages, loss_fn, optimizer, *, microbatches: int, **kwargs) -> SyncPipeline:
  """1F1B, PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, then one forward and one
  backward in turn; BP's update with at most min(M, K-k) micro-batches stashed on stage k."""
  return SyncPipeline("1f1b", stages, loss_fn, optimizer, microbatches=microbatches, **kwargs)
