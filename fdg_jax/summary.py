"""Per-stage summary of a split: blocks, parameters, FLOPs, activations, stash memory, balance.

    python -m fdg_jax.summary --model resnet110 --num-stages 4 --split balanced [--json]
    python -m fdg_jax.summary --model gpt --num-stages 2 --model-kwargs '{"depth": 4}'

FLOPs and activation bytes are per sample; stash bytes are for one batch of --batch-size (the
residuals include the stage's weights, so they are not proportional to the batch size). Nothing
is executed unless --cost time: costs come from XLA's cost analysis of each block
(`partition.block_costs`).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from fdg_jax import models, partition, plans


def _delayed() -> tuple:
  """The registered schedules whose stages stash across ticks (a ring per stage)."""
  return plans.names(delayed=True, microbatched=False)


def summarize(model: models.Model, num_stages: int, how="balanced", *, batch_size: int = 1,
              cost: str = "flops", memory_weight: float = 0.0,
              schedule: str | None = None) -> dict:
  """Summary of `model` split into `num_stages` stages (`how` as in `partition.boundaries`).

  Returns:
    a JSON-ready dict: model, num_stages, split, boundaries, batch_size, cost, imbalance
    (max / mean of the per-stage tick cost) and `stages`, a list of dicts with keys
    start, stop, first, last (block labels), params, flops_per_sample (training forward),
    tick_cost (forward + backward, in `cost` units, for the whole batch),
    activation_bytes_per_sample (stage output), slot_bytes and, for every registered schedule
    whose gradients are delayed (`fdg_jax.plans.names(delayed=True)`: ddg, fdg, pipedream,
    ...), NAME_stash_bytes (for the whole batch).
  """
  if batch_size < 1:
    raise ValueError(f"batch size must be >= 1, got {batch_size}")
  x = model.example_input(batch_size)
  bounds = partition.boundaries(model, num_stages, how, example_input=x, cost=cost,
                                memory_weight=memory_weight, schedule=schedule)
  infos = partition.block_info(model, x)
  fwd = partition.block_costs(model, x, "flops", backward=False)
  tick = partition.block_costs(model, x, cost)
  slots = partition.slot_bytes(model, bounds, x)
  stages = []
  for k, (a, b) in enumerate(partition.stage_ranges(bounds, model.num_blocks)):
    out = infos[b - 1].output
    stages.append({
        "stage": k,
        "start": a,
        "stop": b,
        "first": model.block_names[a],
        "last": model.block_names[b - 1],
        "params": sum(partition.param_count(i.params) for i in infos[a:b]),
        "flops_per_sample": float(fwd[a:b].sum()) / batch_size,
        "tick_cost": float(tick[a:b].sum()),
        "activation_bytes_per_sample": out.size * out.dtype.itemsize // batch_size,
        "slot_bytes": slots[k],
        **{f"{name}_stash_bytes": slots[k] * partition.ring_length(k, num_stages, name)
           for name in _delayed()},
    })
  costs = np.array([s["tick_cost"] for s in stages])
  return {
      "model": model.name,
      "num_stages": num_stages,
      "split": how if isinstance(how, str) else "explicit",
      "boundaries": bounds,
      "batch_size": batch_size,
      "cost": cost,
      "memory_weight": memory_weight,
      "imbalance": float(costs.max() / costs.mean()) if costs.mean() > 0 else 1.0,
      "stages": stages,
  }


def _si(v: float, unit: str = "") -> str:
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(v) >= scale:
      return f"{v / scale:.2f}{prefix}{unit}"
  return f"{v:.0f}{unit}"


def _bytes(v: float) -> str:
  for scale, prefix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
    if abs(v) >= scale:
      return f"{v / scale:.2f} {prefix}"
  return f"{v:.0f} B"


def format_table(s: dict) -> str:
  """The summary as a plain-text table."""
  unit = {"flops": "", "bytes": "B", "time": "s"}[s["cost"]]
  label = {"flops": "tick FLOPs", "bytes": "tick bytes", "time": "tick time"}[s["cost"]]
  rows = [("stage", "blocks", "first..last", "params", "fwd FLOPs/sample",
           f"{label} (batch {s['batch_size']})", "act B/sample",
           *(f"{name.upper()} stash (batch {s['batch_size']})" for name in _delayed()))]
  for st in s["stages"]:
    tick = f"{st['tick_cost'] * 1e3:.3f}ms" if s["cost"] == "time" else _si(st["tick_cost"], unit)
    rows.append((str(st["stage"]), f"{st['start']}-{st['stop'] - 1}",
                 f"{st['first']}..{st['last']}", _si(st["params"]),
                 _si(st["flops_per_sample"]), tick,
                 _bytes(st["activation_bytes_per_sample"]),
                 *(_bytes(st[f"{name}_stash_bytes"]) for name in _delayed())))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = [f"{s['model']}: {s['num_stages']} stages, {s['split']} split, boundaries "
           f"{s['boundaries']}"]
  lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
  lines.append(f"imbalance (max / mean stage {label}, forward + backward): "
               f"{s['imbalance']:.3f}")
  return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, no usage block
    raise _UsageError(message)


class _UsageError(Exception):
  pass


def _parse_split(text: str):
  try:
    return partition.parse_split(text)
  except ValueError as e:
    raise _UsageError(f"--{e}") from None


def main(argv=None) -> int:
  """CLI entry point; returns the exit status (2 on bad arguments)."""
  p = _Parser(prog="python -m fdg_jax.summary", description=__doc__.split("\n\n")[0])
  p.add_argument("--model", required=True, help=f"one of: {', '.join(models.names())}")
  p.add_argument("--num-stages", type=int, required=True)
  p.add_argument("--split", default="balanced",
                 help="balanced | uniform | paper | comma-separated boundaries, e.g. 7,14,21")
  p.add_argument("--cost", default="flops", choices=partition.COSTS,
                 help="what 'balanced' equalises (per-tick forward + backward)")
  p.add_argument("--memory-weight", type=float, default=0.0,
                 help="blend of the normalised stash memory of --schedule into the balanced "
                 "cost, in [0, 1]")
  p.add_argument("--schedule", default="fdg",
                 help="the delayed schedule whose stash --memory-weight weighs")
  p.add_argument("--batch-size", type=int, default=1,
                 help="batch for the stash bytes and the costs (FLOPs are per sample)")
  p.add_argument("--num-classes", type=int, default=None,
                 help="head width (gpt: vocabulary size); default: the model's (10; gpt 256)")
  p.add_argument("--model-kwargs", default="{}",
                 help='model options as JSON, e.g. \'{"depth": 4, "dim": 128}\'')
  p.add_argument("--json", action="store_true", help="print JSON instead of a table")
  try:
    args = p.parse_args(argv)
    how = _parse_split(args.split)
    try:
      model_kwargs = json.loads(args.model_kwargs)
    except json.JSONDecodeError as e:
      raise _UsageError(f"--model-kwargs is not JSON: {e}") from None
    if not isinstance(model_kwargs, dict):
      raise _UsageError("--model-kwargs must be a JSON object")
    model = models.create(args.model, num_classes=args.num_classes, **model_kwargs)
    s = summarize(model, args.num_stages, how, batch_size=args.batch_size, cost=args.cost,
                  memory_weight=args.memory_weight, schedule=args.schedule)
  except (_UsageError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(s, indent=1) if args.json else format_table(s))
  return 0


if __name__ == "__main__":
  sys.exit(main())
