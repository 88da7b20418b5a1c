"""The staleness study: FDG's remedies for stale gradients against BP on the embedded digits.

    python benchmarks/staleness.py                   # the whole study (~1.5 h on 2 CPU cores)
    python benchmarks/staleness.py --cells mlp8:8:paper --seeds 0   # one cell, one seed
    python benchmarks/staleness.py --refine mlp8:8:paper --out docs/results/staleness_refine.json

A cell is (model, K, optimiser):
  models      mlp8: the MLP of 7 hidden blocks of 128 and a head (8 blocks);
              cnn: conv32-pool, conv64-pool, dense128, head (4 blocks, so K <= 4)
  optimisers  paper: SGD momentum 0.9, lr 0.02 (the FDG paper's momentum);
              quickstart: momentum 0.5, lr 0.05 (configs/default.py)
Everything else is configs/default.py (batch 32, cosine schedule with a 1-epoch warm-up,
weight decay 1e-4, 30 epochs).

In every cell:
1. selection, on a held-out 20% of the training split (seed 0; never the test set): FDG's
   beta; each method's hyperparameters (`CANDIDATES`) at beta = 1 and, where the selected
   beta is not 1, the method's best setting again at that beta; the combination
   spike_compensation+weight_prediction likewise. Criterion: final validation accuracy
   (ties: lower validation loss). A diverged run scores -inf.
2. the test: BP (K=1), DDG, FDG beta=1, FDG with the selected beta, every method and the
   combination at their selected settings, for each seed; final test accuracy.
3. robustness of the recommended setting (--recommended): BP, FDG with the cell's
   selected beta, and the recommended setting at other learning rates and widths (mlp8, K=8,
   the paper's momentum), for each seed.
Default cells: mlp8 at K=8 with both optimisers, mlp8 and cnn at K=4 with the paper's (the
quick start's optimiser at K=4 already matches BP without remedies: docs/notes.md, 1).

--refine CELL runs instead a second, less noisy selection round in one cell: REFINE's
settings (the first round's best on validation, and their neighbours) on the validation split
with every seed, the best mean then tested with every seed.

Runs go to --jobs worker processes (each one JAX process with 4 CPU devices). Writes --out
(JSON: every run, the selections, summaries) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity import (ROOT, apply_overrides, load_config, markdown_table, run_one,  # noqa: E402
                    summarize, validation_split)

MODELS = {
    "mlp8": {"model": "mlp", "model_kwargs.widths": (128,) * 7},
    "cnn": {"model": "cnn", "model_kwargs": {"channels": (32, 64), "hidden": 128}},
}
OPTIMISERS = {
    "paper": {"momentum": 0.9, "learning_rate": 0.02},
    "quickstart": {"momentum": 0.5, "learning_rate": 0.05},
}
BETAS = (1.0, 0.8, 0.5, 0.2)
# Each method's hyperparameter settings searched on the validation split.
# (staleness_ramp_epochs -1: no ramp, lr/d_k for the whole run.)
CANDIDATES = {
    "lr_by_delay": [{"staleness_ramp_epochs": 3.0}, {"staleness_ramp_epochs": -1.0},
                    {"staleness_ramp_epochs": -1.0, "staleness_lr_power": 0.5}],
    "weight_prediction": [{}],
    "spike_compensation": [{}],
    "dc": [{"dc_lambda": 0.04}, {"dc_adaptive": True}],
    "nesterov_delay": [{"nesterov_gamma": 0.9}, {"nesterov_gamma": 0.99}],
    "spike_compensation+weight_prediction": [{}],
    "spike_compensation+lr_by_delay": [
        {"staleness_ramp_epochs": -1.0},
        {"staleness_ramp_epochs": -1.0, "staleness_lr_power": 0.5}],
}
DEFAULT_CELLS = ("mlp8:8:paper", "mlp8:8:quickstart", "mlp8:4:paper", "cnn:4:paper")


# ------------------------------------------------------------------------------ runs
def _worker(task: dict) -> dict:
  """One training run in a worker process (task: config path, overrides, fields, split)."""
  import ml_collections
  base = apply_overrides(load_config(task["config"]), task["overrides"])
  fields = dict(task["fields"])
  if "model_kwargs" in fields:  # the model's arguments, replaced as a whole
    base.model_kwargs = ml_collections.ConfigDict(fields.pop("model_kwargs"))
  task = {**task, "fields": fields}
  if task["validation"]:
    with validation_split(task["validation"]):
      record = run_one(base, task["workroot"], task["name"], **task["fields"])
  else:
    record = run_one(base, task["workroot"], task["name"], **task["fields"])
  record.pop("curve", None)
  return {**record, **task["tags"], "fields": _jsonable(task["fields"]),
          "model_kwargs": _jsonable(base.model_kwargs.to_dict())}


def _jsonable(fields: dict) -> dict:
  return {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()}


class Runner:
  """Runs batches of tasks on a pool of worker processes."""

  def __init__(self, args):
    self.args = args
    self.pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn"))
    self.records: list[dict] = []

  def run(self, tasks: list[dict]) -> list[dict]:
    for t in tasks:
      t.update(config=self.args.config, overrides=self.args.set, workroot=self.args.workdir)
    out = list(self.pool.map(_worker, tasks))
    self.records += out
    return out

  def close(self):
    self.pool.shutdown()


def cell_fields(model: str, k: int, optimiser: str) -> dict:
  return {**MODELS[model], **OPTIMISERS[optimiser], "algorithm": "fdg", "num_stages": k}


def _task(name: str, fields: dict, validation: float | None, **tags) -> dict:
  fields = dict(fields)
  # ConfigDict paths such as model_kwargs.widths are set through the overrides mechanism.
  nested = {k: fields.pop(k) for k in list(fields) if "." in k}
  if "model_kwargs" in fields:
    fields["model_kwargs"] = dict(fields["model_kwargs"])
  for key, value in nested.items():
    parent, child = key.split(".")
    fields.setdefault(parent, {})[child] = value
  return {"name": name, "fields": fields, "validation": validation, "tags": tags}


def method_name(staleness: str, beta: float) -> str:
  label = "FDG" if beta == 1.0 else f"FDG β={beta:g}"
  return label if staleness == "none" else f"{label} + {staleness}"


def _score(r: dict) -> tuple:
  acc = r["test_accuracy"]
  if r["diverged"] or acc is None or math.isnan(acc):
    return (-math.inf, -math.inf)
  return (acc, -r["test_loss"])


# ------------------------------------------------------------------------------ selection
def select(runner: Runner, cell: str, args) -> dict:
  """The cell's beta and each method's setting, chosen on the validation split (seed 0)."""
  model, k, optimiser = cell.split(":")
  base = cell_fields(model, int(k), optimiser)
  frac = args.val_fraction
  tag = cell.replace(":", "_")
  tasks = [_task(f"val_{tag}_beta{b:g}", {**base, "beta": b, "seed": 0}, frac, cell=cell,
                 part="select", method=method_name("none", b)) for b in BETAS]
  for method, settings in CANDIDATES.items():
    for i, s in enumerate(settings):
      tasks.append(_task(f"val_{tag}_{method}_{i}",
                         {**base, "beta": 1.0, "staleness": method, "seed": 0, **s}, frac,
                         cell=cell, part="select", method=method, setting=i))
  rows = runner.run(tasks)
  beta = max((r for r in rows if r["part"] == "select" and "setting" not in r),
             key=lambda r: (_score(r), r["beta"]))["beta"]
  chosen = {"beta": beta, "methods": {}}
  again = []
  for method in CANDIDATES:
    best = max((r for r in rows if r.get("method") == method), key=_score)
    chosen["methods"][method] = {"fields": CANDIDATES[method][best["setting"]], "beta": 1.0,
                                 "val": best}
    if beta != 1.0:
      again.append(_task(f"val_{tag}_{method}_beta{beta:g}",
                         {**base, "beta": beta, "staleness": method, "seed": 0,
                          **CANDIDATES[method][best["setting"]]}, frac, cell=cell,
                         part="select", method=method, setting=best["setting"]))
  for r in runner.run(again):
    entry = chosen["methods"][r["method"]]
    if _score(r) > _score(entry["val"]):
      entry.update(beta=beta, val=r)
  for entry in chosen["methods"].values():
    v = entry.pop("val")
    entry.update(val_accuracy=v["test_accuracy"], val_diverged=v["diverged"])
  return chosen


# ------------------------------------------------------------------------------ the test
def test_cell(runner: Runner, cell: str, chosen: dict, seeds) -> list[dict]:
  model, k, optimiser = cell.split(":")
  base = cell_fields(model, int(k), optimiser)
  tag = cell.replace(":", "_")
  tasks = []
  for seed in seeds:
    tasks.append(_task(f"{tag}_bp_s{seed}", {**base, "algorithm": "bp", "num_stages": 1,
                                             "seed": seed}, None, cell=cell, part="test",
                       method="BP K=1"))
    tasks.append(_task(f"{tag}_ddg_s{seed}", {**base, "algorithm": "ddg", "seed": seed},
                       None, cell=cell, part="test", method="DDG"))
    for b in sorted({1.0, chosen["beta"]}, reverse=True):
      tasks.append(_task(f"{tag}_fdg_beta{b:g}_s{seed}", {**base, "beta": b, "seed": seed},
                         None, cell=cell, part="test", method=method_name("none", b)))
    for method, entry in chosen["methods"].items():
      tasks.append(_task(f"{tag}_{method}_s{seed}",
                         {**base, "beta": entry["beta"], "staleness": method, "seed": seed,
                          **entry["fields"]}, None, cell=cell, part="test",
                         method=method_name(method, entry["beta"])))
  return runner.run(tasks)


def robustness(runner: Runner, args, chosen: dict) -> list[dict]:
  """The recommended method, at the setting selected in the mlp8:8:paper cell, at other
  learning rates and widths (mlp8, K=8, momentum 0.9), next to BP and FDG with that cell's
  selected beta."""
  staleness = args.recommended
  entry = chosen["methods"][staleness]
  beta, chosen_beta = entry["beta"], chosen["beta"]
  tasks = []
  for label, extra in (("lr=0.01", {"learning_rate": 0.01}), ("lr=0.05", {"learning_rate": 0.05}),
                       ("width=256", {"model_kwargs.widths": (256,) * 7})):
    base = {**cell_fields("mlp8", 8, "paper"), **extra}
    for seed in args.seeds:
      for name, fields in (("BP K=1", {"algorithm": "bp", "num_stages": 1}),
                           (method_name("none", chosen_beta), {"beta": chosen_beta}),
                           (method_name(staleness, beta), {"beta": beta,
                                                           "staleness": staleness,
                                                           **entry["fields"]})):
        tasks.append(_task(f"robust_{label}_{name}_s{seed}".replace(" ", "_").replace("=", ""),
                           {**base, **fields, "seed": seed}, None, part="robust",
                           setting=label, method=f"{label}: {name}"))
  return runner.run(tasks)


def refine(runner: Runner, args) -> dict:
  """A second selection round in one cell, less noisy than the first: each of REFINE's
  settings on the validation split with every seed of --seeds; the best mean validation
  accuracy is tested on the test set with every seed."""
  cell = args.refine
  model, k, optimiser = cell.split(":")
  base = cell_fields(model, int(k), optimiser)
  tag = "refine_" + cell.replace(":", "_")
  tasks = []
  for i, (method, beta, fields) in enumerate(REFINE):
    for seed in args.seeds:
      tasks.append(_task(f"val_{tag}_{i}_s{seed}", {**base, "beta": beta, "staleness": method,
                                                    "seed": seed, **fields},
                         args.val_fraction, cell=cell, part="refine_select", setting=i,
                         method=method_name(method, beta) + _fields_label(fields)))
  rows = runner.run(tasks)
  table = summarize(rows, lambda r: r["method"])
  best = max(range(len(REFINE)), key=lambda i: (
      _mean_score([r for r in rows if r["setting"] == i])))
  method, beta, fields = REFINE[best]
  tests = runner.run([_task(f"{tag}_best_s{seed}", {**base, "beta": beta, "staleness": method,
                                                    "seed": seed, **fields}, None, cell=cell,
                            part="refine_test",
                            method=method_name(method, beta) + _fields_label(fields))
                      for seed in args.seeds])
  return {"cell": cell, "validation": table, "chosen": {"staleness": method, "beta": beta,
                                                        "fields": fields},
          "test": summarize(tests, lambda r: r["method"])}


# The second round's settings: the first round's best on the validation split, around them.
REFINE = [
    ("spike_compensation+lr_by_delay", 1.0, {"staleness_ramp_epochs": -1.0}),
    ("spike_compensation+lr_by_delay", 0.8, {"staleness_ramp_epochs": -1.0}),
    ("spike_compensation+lr_by_delay", 1.0, {"staleness_ramp_epochs": -1.0,
                                             "staleness_lr_power": 0.5}),
    ("lr_by_delay", 1.0, {"staleness_ramp_epochs": -1.0}),
    ("lr_by_delay", 0.8, {"staleness_ramp_epochs": -1.0}),
    ("none", 0.5, {}),
]


def _fields_label(fields: dict) -> str:
  parts = []
  if fields.get("staleness_ramp_epochs", 0) < 0:
    parts.append(f"lr·d^-{fields.get('staleness_lr_power', 1.0):g}")
  return f" ({', '.join(parts)})" if parts else ""


def _mean_score(rows) -> float:
  accs = [r["test_accuracy"] for r in rows]
  if any(r["diverged"] or a is None or math.isnan(a) for r, a in zip(rows, accs)):
    return -math.inf
  return sum(accs) / len(accs)


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "configs" / "default.py"))
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field of every run, e.g. --set num_epochs=5")
  parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS),
                      help="model:K:optimiser cells (models: mlp8, cnn; optimisers: paper, "
                           "quickstart)")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--val_fraction", type=float, default=0.2)
  parser.add_argument("--recommended", default="spike_compensation+lr_by_delay",
                      help="a CANDIDATES method checked at other lrs and widths after the "
                           "mlp8:8:paper cell, at its setting selected there (empty: skip)")
  parser.add_argument("--jobs", type=int, default=2, help="worker processes")
  parser.add_argument("--refine", default="",
                      help="only a second selection round in this cell (REFINE's settings, "
                           "validation with every seed), e.g. mlp8:8:paper")
  parser.add_argument("--workdir", default=str(ROOT / "runs" / "staleness"))
  parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "staleness.json"))
  args = parser.parse_args(argv)
  for cell in args.cells:
    model, k, optimiser = cell.split(":")
    if model not in MODELS or optimiser not in OPTIMISERS or not k.isdigit():
      parser.error(f"bad cell {cell!r}: want model:K:optimiser, e.g. mlp8:8:paper")

  started = time.time()
  runner = Runner(args)
  if args.refine:
    try:
      result = refine(runner, args)
    finally:
      runner.close()
    result["runs"] = runner.records
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1, allow_nan=True)
    print("validation (every seed):\n" + markdown_table(result["validation"], None))
    print(f"\nchosen: {result['chosen']}\ntest:\n" + markdown_table(result["test"], None))
    return 0
  result = {"description": "FDG staleness remedies vs BP on digits; benchmarks/staleness.py",
            "config": str(pathlib.Path(args.config).resolve().relative_to(ROOT)),
            "overrides": args.set, "seeds": args.seeds, "candidates": CANDIDATES,
            "betas": BETAS, "cells": {}}
  try:
    for cell in args.cells:
      print(f"== {cell}: selection on the validation split", flush=True)
      chosen = select(runner, cell, args)
      print(f"== {cell}: selected beta {chosen['beta']:g}; " + ", ".join(
          f"{m}: {e['fields']} beta {e['beta']:g}" for m, e in chosen["methods"].items()),
            flush=True)
      runs = test_cell(runner, cell, chosen, args.seeds)
      summary = summarize(runs, lambda r: r["method"])
      bp = next(r["test_accuracy_mean"] for r in summary if r["method"] == "BP K=1")
      result["cells"][cell] = {"chosen": chosen, "summary": summary}
      print(f"\n{cell}:\n" + markdown_table(summary, bp) + "\n", flush=True)
      _save(args.out, result, runner, started)
      if cell == "mlp8:8:paper" and args.recommended:
        runs = robustness(runner, args, chosen)
        result["robustness"] = summarize(runs, lambda r: r["method"])
        print("\nrobustness:\n" + markdown_table(result["robustness"], None), flush=True)
        _save(args.out, result, runner, started)
  finally:
    runner.close()
    _save(args.out, result, runner, started)
  print(f"wrote {args.out} in {time.time() - started:.0f} s")
  return 0


def _save(path, result, runner, started):
  result["runs"] = runner.records
  result["total_time_s"] = time.time() - started
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, allow_nan=True)


if __name__ == "__main__":
  sys.exit(main())
