"""Pictures of the tick schedules: which stage works on which batch at each tick.

    state, tr = viz.trace(schedule, state, batches)   # runs schedule.step once per batch
    viz.spacetime(tr, ax=ax)                          # the space-time diagram
    tr.measured_delays()                              # == schedule.delays

Nothing here is drawn from the rules in docs/algorithms.md: the trace records what the library did.

- Updates: `metrics["updated"][k]` of `Schedule.step`, the index of the batch whose gradient
  stage k applied at the tick (None if it did not update).
- Forwards: `step` reports no forward events, so they are read from the stage state the
  schedule keeps for its delayed backward (see the `fdg_jax.schedules` docstring): a stage
  k < K-1 forwarded at tick t iff its `pushes` counter advanced, and the batch it forwarded is
  the one recorded in the stash slot it wrote, `stash_batch[(pushes - 1) % D_k]`. The last
  stage keeps no stash; it forwards exactly the batch that reaches the loss, `metrics["batch"]`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

IDLE = -1


@dataclasses.dataclass(frozen=True)
class Trace:
  """What every stage did at every tick of a run.

  Attributes:
    algorithm: "bp", "ddg" or "fdg".
    forward: int [T, K]; the batch stage k forwarded at tick t, or -1 (IDLE).
    update: int [T, K]; the batch whose gradient stage k applied at tick t, or -1.
    first_tick: the schedule tick of row 0.
  """

  algorithm: str
  forward: np.ndarray
  update: np.ndarray
  first_tick: int = 0

  @property
  def num_ticks(self) -> int:
    return self.forward.shape[0]

  @property
  def num_stages(self) -> int:
    return self.forward.shape[1]

  def measured_delays(self) -> tuple[int | None, ...]:
    """Per stage: update tick minus forward tick of the same batch.

    None for a stage that applied no gradient of a batch it forwarded within the trace.
    Raises ValueError if a stage's delay is not the same for every batch.
    """
    out = []
    for k in range(self.num_stages):
      fwd_tick = {int(b): t for t, b in enumerate(self.forward[:, k]) if b != IDLE}
      gaps = {t - fwd_tick[int(b)] for t, b in enumerate(self.update[:, k])
              if b != IDLE and int(b) in fwd_tick}
      if len(gaps) > 1:
        raise ValueError(f"stage {k}: the delay varies over the trace: {sorted(gaps)}")
      out.append(gaps.pop() if gaps else None)
    return tuple(out)


def _host_int(x) -> int:
  return int(np.asarray(x))


def trace(schedule, state, batches: Iterable) -> tuple[dict, Trace]:
  """Runs `schedule.step(state, batch)` for each batch and records every stage's work.

  Args:
    schedule: a `fdg_jax.Schedule`.
    state: its state (consumed, as by `step`).
    batches: an iterable of `(x, y)` batches, one per tick.

  Returns:
    (the state after the last tick, a `Trace`).
  """
  K = schedule.num_stages
  rings = schedule.ring_sizes
  first_tick = _host_int(state["tick"])
  forwards, updates = [], []
  for batch in batches:
    # `step` donates the state it is given: read the counters before the call.
    pushes = [_host_int(schedule.stage_state(state, k)["pushes"]) for k in range(K - 1)]
    state, metrics = schedule.step(state, batch)
    fwd = [IDLE] * K
    for k in range(K - 1):
      s = schedule.stage_state(state, k)
      now = _host_int(s["pushes"])
      if now > pushes[k]:
        fwd[k] = _host_int(np.asarray(s["stash_batch"])[(now - 1) % rings[k]])
    if "batch" in metrics:
      fwd[K - 1] = _host_int(metrics["batch"])
    forwards.append(fwd)
    updates.append([IDLE if u is None else _host_int(u) for u in metrics["updated"]])
  shape = (len(forwards), K)
  return state, Trace(schedule.algorithm, np.asarray(forwards, np.int64).reshape(shape),
                      np.asarray(updates, np.int64).reshape(shape), first_tick)


def spacetime(tr: Trace, ax=None, *, title: str | None = None, highlight: int | None = None,
              cmap: str = "tab10"):
  """Draws a space-time diagram of `tr`: ticks left to right, stage 0 at the top.

  Each (tick, stage) cell has two halves: the upper one "F b" when the stage forwarded batch b,
  the lower one "U b" when it applied batch b's gradient (backward + optimizer update); blank
  halves are idle. Colours identify batches. `highlight` outlines every cell of one batch, so
  its way down the forward and back up the backward can be followed.

  Returns the matplotlib Axes.
  """
  import matplotlib.pyplot as plt
  from matplotlib.patches import Rectangle

  if ax is None:
    _, ax = plt.subplots(figsize=(0.6 * tr.num_ticks + 1.5, 0.55 * tr.num_stages + 1))
  colours = plt.get_cmap(cmap)
  T, K = tr.num_ticks, tr.num_stages
  for t in range(T):
    for k in range(K):
      ax.add_patch(Rectangle((t, k), 1, 1, facecolor="none", edgecolor="0.85", lw=0.5))
      for half, table, letter, alpha in ((0, tr.forward, "F", 0.35), (1, tr.update, "U", 1.0)):
        b = int(table[t, k])
        if b == IDLE:
          continue
        corner = (t + 0.04, k + 0.04 + 0.46 * half)
        ax.add_patch(Rectangle(corner, 0.92, 0.44, facecolor=colours(b % colours.N),
                               alpha=alpha, edgecolor="none"))
        if b == highlight:
          ax.add_patch(Rectangle(corner, 0.92, 0.44, facecolor="none", edgecolor="black",
                                 lw=1.8))
        ax.text(t + 0.5, k + 0.27 + 0.46 * half, f"{letter}{b}", ha="center", va="center",
                fontsize=7, color="black" if half == 0 else "white")
  delays = tr.measured_delays()
  for k, d in enumerate(delays):
    ax.text(T + 0.15, k + 0.5, "d=?" if d is None else f"d={d}", va="center", fontsize=8)
  ax.set_xlim(0, T + 0.9)
  ax.set_ylim(K, 0)
  ax.set_xticks(np.arange(T) + 0.5, [str(tr.first_tick + t) for t in range(T)], fontsize=7)
  ax.set_yticks(np.arange(K) + 0.5, [f"stage {k}" for k in range(K)], fontsize=8)
  ax.tick_params(length=0)
  for side in ("top", "right", "bottom", "left"):
    ax.spines[side].set_visible(False)
  ax.set_xlabel("tick", fontsize=8)
  ax.set_title(title or tr.algorithm.upper(), fontsize=10, loc="left")
  return ax
