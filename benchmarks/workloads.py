"""BP against FDG on the transformer workloads: ViT on digits, a small GPT on the stdlib corpus.

    python benchmarks/workloads.py                     # both (42 min on 2 CPU cores)
    python benchmarks/workloads.py --parts vit --seeds 0

ViT: patch 2 on the 8x8 digits (16 tokens), width 64, 6 pre-norm blocks of 4 heads (8 blocks
with the embedding and the head), Adam lr 1e-3 with a cosine schedule, 30 epochs, batch 32.
GPT: configs/lm.py with 6 causal blocks of width 128 (8 blocks), trained for
--lm_epochs epochs on the first --lm_bytes bytes of the training split, validation loss per
byte and perplexity on the first --lm_bytes of the validation split.
BP at K=1, FDG at K=4 and K=8 (balanced splits; Adam's update does not see beta, so beta=1),
for each seed. Writes --out and prints markdown tables.

    python benchmarks/workloads.py --select_k8 none weight_prediction \
        lr_by_delay:staleness_ramp_epochs=5 --test_seeds 0 1 2

--select_k8 picks a staleness remedy for the ViT at K=8 instead: each METHOD[:field=value,...]
(config fields; staleness_ramp_epochs is -1 unless given) trains on 80% of the training split
(--val_fraction, seed 0) and is scored on the rest, by final accuracy (ties: lower loss); the
best then runs on the test split with each --test_seeds. Writes
docs/results/workloads_k8_selection.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity import ROOT  # noqa: E402
from staleness import Runner, _score, _task  # noqa: E402

VIT = {"model": "vit", "optimizer": "adam", "learning_rate": 1e-3, "momentum": 0.0,
       "weight_decay": 0.0, "split": "balanced",
       "model_kwargs": {"input_shape": (8, 8, 1), "patch_size": 2, "dim": 64, "depth": 6,
                        "num_heads": 4}}
GPT = {"model_kwargs": {"seq_len": 128, "dim": 128, "depth": 6, "num_heads": 4}}
METHODS = (("BP K=1", {"algorithm": "bp", "num_stages": 1}),
           ("FDG K=4", {"algorithm": "fdg", "num_stages": 4}),
           ("FDG K=8", {"algorithm": "fdg", "num_stages": 8}))
KEYS = ["test_accuracy", "test_loss"]
SCALE = {"test_accuracy": 100.0, "test_loss": 1.0, "test_perplexity": 1.0}


def k8_row(spec: str) -> tuple[str, dict]:
  """"METHOD[:field=value,...]" -> ("FDG K=8 + spec", the fields of FDG K=8 with that staleness
  method); staleness_ramp_epochs is -1 (lr_by_delay: lr/d_k for the whole run) unless given."""
  method, _, settings = spec.partition(":")
  fields = {"algorithm": "fdg", "num_stages": 8, "staleness": method,
            "staleness_ramp_epochs": -1.0}
  for item in filter(None, settings.split(",")):
    key, value = item.split("=", 1)
    try:
      fields[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      fields[key] = value
  return f"FDG K=8 + {spec}", fields


def summary(rows, keys, methods=METHODS):
  out = []
  for method, _ in methods:
    rs = [r for r in rows if r["method"] == method]
    entry = {"method": method, "runs": len(rs), "diverged": sum(r["diverged"] for r in rs)}
    for key in keys:
      vals = [r[key] for r in rs if not r["diverged"]]
      entry[key] = (statistics.fmean(vals) if vals else float("nan"),
                    statistics.stdev(vals) if len(vals) > 1 else 0.0)
    entry["wall_time"] = statistics.fmean(r["wall_time"] for r in rs)
    out.append(entry)
  return out


def table(rows, keys, scale) -> str:
  head = "| method | runs | " + " | ".join(keys) + " | wall time s |"
  lines = [head, "|" + "---|" * (len(keys) + 3)]
  for r in rows:
    cells = [f"{scale[k] * r[k][0]:.2f} ± {scale[k] * r[k][1]:.2f}" for k in keys]
    lines.append(f"| {r['method']} | {r['runs']} | " + " | ".join(cells)
                 + f" | {r['wall_time']:.0f} |")
  return "\n".join(lines)


def run_part(args, part: str, methods, seeds, validation: float | None = None) -> list[dict]:
  """Every (seed, method) run of one workload, on the test split, or with `validation` (a
  fraction of the training split held out in its place) on the validation split."""
  if part == "vit":
    args.config, base = str(ROOT / "configs" / "default.py"), VIT
  else:
    args.config = str(ROOT / "configs" / "lm.py")
    base = {**GPT, "text_max_bytes": args.lm_bytes, "num_epochs": args.lm_epochs}
  prefix = "val_" if validation else ""
  runner = Runner(args)
  try:
    tasks = [_task(f"{prefix}{part}_{_slug(label)}_s{seed}", {**base, **fields, "seed": seed},
                   validation, method=label)
             for seed in seeds for label, fields in methods]
    rows = runner.run(tasks)  # the Runner fills in config, overrides and workroot
  finally:
    runner.close()
  for r in rows:
    r["test_perplexity"] = math.exp(r["test_loss"]) if not r["diverged"] else math.nan
  return rows


def _slug(label: str) -> str:
  """A run's directory name from its label: "FDG K=8 + dc:dc_adaptive=True" -> FDG_K8_+_dc_..."""
  return re.sub(r"[^\w.+-]+", "_", label.replace("=", ""))


def select_k8(args) -> dict:
  """--select_k8: each candidate on the validation split (seed 0), best first; the best on the
  test split with each of --test_seeds."""
  candidates = dict(k8_row(spec) for spec in args.select_k8)
  rows = sorted(run_part(args, "vit", candidates.items(), [0], args.val_fraction),
                key=_score, reverse=True)
  validation = [{"candidate": r["method"], "val_accuracy": r["test_accuracy"],
                 "val_loss": r["test_loss"], "diverged": r["diverged"],
                 "wall_time": r["wall_time"]} for r in rows]
  print("\nvalidation (seed 0; test_* are the held-out part of train):\n"
        + table(summary(rows, KEYS, [(r["method"], None) for r in rows]), KEYS, SCALE))
  best = rows[0]["method"]
  result = {"description": "FDG K=8 staleness remedies for the ViT on digits, chosen on a "
                           "validation split; benchmarks/workloads.py --select_k8",
            "val_fraction": args.val_fraction, "val_seed": 0, "validation": validation,
            "chosen": {"candidate": best, "fields": candidates[best]}, "val_runs": rows}
  if args.test_seeds:
    runs = run_part(args, "vit", [(best, candidates[best])], args.test_seeds)
    result["test"] = {"seeds": args.test_seeds, "summary": summary(runs, KEYS, [(best, None)]),
                      "runs": runs}
    print(f"\ntest, {best}:\n" + table(result["test"]["summary"], KEYS, SCALE))
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", nargs="+", default=["vit", "lm"], choices=("vit", "lm"))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--lm_bytes", type=int, default=1_000_000)
  parser.add_argument("--lm_epochs", type=int, default=1)
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--k8_staleness", default="",
                      help="also FDG K=8 with this staleness method, METHOD[:field=value,...] "
                           "(lr_by_delay: lr/d_k without ramp unless staleness_ramp_epochs "
                           "is given), e.g. lr_by_delay")
  parser.add_argument("--k8_only", action="store_true",
                      help="with --k8_staleness: run only that row (the others are in --out "
                           "of an earlier run)")
  parser.add_argument("--select_k8", nargs="+", default=[], metavar="METHOD[:field=value,...]",
                      help="instead: choose among these FDG K=8 remedies for the ViT on the "
                           "validation split (none: plain FDG)")
  parser.add_argument("--val_fraction", type=float, default=0.2)
  parser.add_argument("--test_seeds", type=int, nargs="+", default=[],
                      help="--select_k8: test the chosen remedy with these seeds")
  parser.add_argument("--workdir", default=str(ROOT / "runs" / "workloads"))
  parser.add_argument("--out", default="",
                      help="default docs/results/workloads.json (--select_k8: "
                           "docs/results/workloads_k8_selection.json)")
  args = parser.parse_args(argv)
  args.set = []
  name = "workloads_k8_selection.json" if args.select_k8 else "workloads.json"
  args.out = args.out or str(ROOT / "docs" / "results" / name)
  methods = [] if args.k8_only else list(METHODS)
  methods += [k8_row(args.k8_staleness)] if args.k8_staleness else []
  if not methods:
    parser.error("--k8_only needs --k8_staleness")
  started = time.time()
  if args.select_k8:
    result = select_k8(args)
  else:
    result = {"description": "BP vs FDG on ViT/digits and GPT/stdlib text; "
                             "benchmarks/workloads.py", "seeds": args.seeds}
    for part in args.parts:
      rows = run_part(args, part, methods, args.seeds)
      keys = KEYS + (["test_perplexity"] if part == "lm" else [])
      result[part] = {"summary": summary(rows, keys, methods), "runs": rows}
      print(f"\n{part}:\n" + table(result[part]["summary"], keys, SCALE), flush=True)
  result["total_time_s"] = time.time() - started
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1, allow_nan=True)
  print(f"wrote {args.out} in {result['total_time_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
