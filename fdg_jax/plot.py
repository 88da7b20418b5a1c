"""Learning curves of one or more runs.

    python -m fdg_jax.plot RUN_DIR [RUN_DIR ...] -o curves.png
    python -m fdg_jax.plot RUN_DIR [RUN_DIR ...] --telemetry -o staleness.png

Four panels: test accuracy and test loss against epoch and against wall time, one line per
run, labelled by algorithm, K and beta (from the run's config.json). `--telemetry` draws a
run's staleness telemetry instead (`telemetry_every_steps`): per-stage weight discrepancy
and stale-vs-fresh gradient cosine against the step, one line per run and stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load_run(run_dir: str) -> tuple[str, list[dict]]:
  """(label, metric records) of a run directory written by `train_and_evaluate`."""
  metrics = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(metrics):
    raise FileNotFoundError(f"{run_dir} has no metrics.jsonl; is it a training run directory?")
  with open(metrics) as f:
    records = [json.loads(l) for l in f if l.strip()]
  label = os.path.basename(os.path.normpath(run_dir))
  config_path = os.path.join(run_dir, "config.json")
  if os.path.exists(config_path):
    with open(config_path) as f:
      c = json.load(f)
    label = f"{c.get('algorithm', '?').upper()} K={c.get('num_stages', '?')}"
    if c.get("beta", 1.0) != 1.0:  # only a schedule that takes beta runs with one
      label += f" β={c['beta']:g}"
    label += f" seed={c.get('seed', 0)}"
  return label, records


def plot_runs(run_dirs, output: str) -> None:
  """Draws the four panels for `run_dirs` into the image file `output`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
  for run_dir in run_dirs:
    label, records = load_run(run_dir)
    records = [r for r in records if "test_accuracy" in r]  # rows of evaluations only
    for row, key in enumerate(("test_accuracy", "test_loss")):
      for col, x_key in enumerate(("epoch", "wall_time")):
        axes[row, col].plot([r[x_key] for r in records], [r[key] for r in records],
                            label=label, marker="." if len(records) < 40 else None)
  for row, key in enumerate(("test accuracy", "test loss")):
    for col, x_label in enumerate(("epoch", "wall time (s)")):
      ax = axes[row, col]
      ax.set_xlabel(x_label)
      ax.set_ylabel(key)
      ax.grid(alpha=0.3)
  axes[0, 0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(output, dpi=110)
  plt.close(fig)


def plot_telemetry(run_dirs, output: str) -> None:
  """Per-stage weight discrepancy and gradient cosine of `run_dirs` into `output`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  drawn = 0
  for run_dir in run_dirs:
    label, records = load_run(run_dir)
    rows = [r for r in records if "grad_cosine" in r]
    if not rows:
      continue
    for col, key in enumerate(("weight_discrepancy", "grad_cosine")):
      for k in range(len(rows[0][key])):
        points = [(r["step"], r[key][k]) for r in rows if r[key][k] is not None]
        if points:
          axes[col].plot(*zip(*points), label=f"{label} stage {k}")
          drawn += 1
  if not drawn:
    plt.close(fig)
    raise FileNotFoundError("no telemetry in these runs; train with "
                            "--config.telemetry_every_steps=N")
  for ax, name in zip(axes, ("||θ_now − θ_fwd|| / ||θ_now||", "cos(stale, fresh gradient)")):
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(output, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m fdg_jax.plot",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
  parser.add_argument("-o", "--output", default="curves.png", help="image file to write")
  parser.add_argument("--telemetry", action="store_true",
                      help="draw the staleness telemetry instead of the learning curves")
  args = parser.parse_args(argv)
  try:
    (plot_telemetry if args.telemetry else plot_runs)(args.runs, args.output)
  except FileNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
