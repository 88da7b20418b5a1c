"""How stale each stage's gradient is, and how many stash slots that takes.

Shared by the schedules (which allocate the rings) and the partitioner (which sizes them
before anything is allocated).
"""

from __future__ import annotations

from fdg_jax import plans


def delay(algorithm: str, stage: int, num_stages: int) -> int:
  """Ticks between stage `stage` forwarding a batch and applying that batch's gradient
  (BP 0, DDG K-1-k, FDG 2(K-1-k)), as the algorithm's plan implies (`fdg_jax.plans`)."""
  return _plan(algorithm, num_stages).delays[stage]


def ring_size(algorithm: str, stage: int, num_stages: int) -> int:
  """Slots in stage `stage`'s stash: the most entries the plan has it hold at once (BP 1,
  DDG K-k: its forward of b_t is stashed before its backward frees the oldest slot, FDG
  2(K-1-k); the last stage keeps none: its loss is immediate)."""
  return _plan(algorithm, num_stages).ring_sizes[stage]


def _plan(algorithm: str, num_stages: int):
  return plans.plan(algorithm, num_stages)


def ring_heads_default(platform: str) -> bool:
  """Whether the schedules keep ring heads on `platform` by default.

  A head exists so that no tick reads a ring before writing it, which XLA otherwise answers
  with copies of the ring. XLA:CPU with the schedules' default compiler options (copy
  insertion with region analysis, `schedules.compiler_options_for`) updates the rings in
  place without one; elsewhere the head stays (not measured on GPUs and TPUs).
  """
  return platform != "cpu"


def slots_held(algorithm: str, stage: int, num_stages: int, heads: bool = True) -> int:
  """Stash slots stage `stage` holds: its ring, and with `heads` the ring's head where the
  ring has two slots or more (a copy of the entry the next tick reads, kept so that no tick
  reads the ring before writing it; `Schedule._stage_with_ring`). A one-slot ring (BP) is
  written and read by separate calls and keeps no head."""
  d = ring_size(algorithm, stage, num_stages)
  return d + 1 if heads and d > 1 else d
