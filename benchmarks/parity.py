"""Accuracy parity of BP, DDG and FDG on the embedded digits data (the quick-start config).

    python benchmarks/parity.py                      # ~10 min on 2 CPU cores
    python benchmarks/parity.py --plot_only          # redraw docs/results/parity.png from
                                                     # docs/results/parity.json

Every run is `fdg_jax.trainer.train_and_evaluate` on `configs/default.py` (MLP 4x128, batch 32,
SGD lr 0.05 momentum 0.5, cosine, 30 epochs, 4 CPU devices) with only the method changed, run
one after the other in this process. Three parts:

1. beta selection (seed 0 only), NOT on the test set: FDG K=2 and K=4 for each beta in --betas,
   trained on 80% of the digits training split and scored on the held-out 20% (fixed
   permutation, seed 0). The beta with the best final validation accuracy (ties: lower
   validation loss, then the larger beta) is "FDG best beta" for that K.
2. the study: BP (K=1), DDG K=2/4, FDG K=2/4 with beta=1 and with the selected beta; seeds
   --seeds; full training split, final test accuracy.
3. side experiment: the staleness failure mode. BP (K=1) and FDG K=4 with beta 1 and 0.5, with
   SGD momentum 0.9 at lr 0.01, 0.05 and 0.1, same seeds.

Writes --out (JSON: every run's config, final metrics and per-epoch curve, the beta search,
summaries) and --plot (test accuracy against epoch, mean over seeds); prints markdown tables.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ configs
def load_config(path: str):
  """`get_config()` of a config file (as train.py's --config does)."""
  spec = importlib.util.spec_from_file_location("parity_base_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(None)


def apply_overrides(config, overrides):
  """Applies "a.b=value" strings (value a Python literal, else a string) to a ConfigDict."""
  for item in overrides or ():
    key, _, text = item.partition("=")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    node = config
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return config


def method_label(algorithm: str, k: int, beta: float = 1.0) -> str:
  if algorithm == "bp":
    return "BP K=1"
  label = f"{algorithm.upper()} K={k}"
  if algorithm == "fdg":
    label += f" β={beta:g}"
  return label


# ------------------------------------------------------------------------------ validation data
@contextlib.contextmanager
def validation_split(fraction: float, seed: int = 0):
  """Makes `fdg_jax.data.load` return a train/validation split of the training split.

  "train" -> the first (1 - fraction) of a fixed permutation of the training split, "test" ->
  the rest, so that choosing beta never looks at the test set.
  """
  import numpy as np
  from fdg_jax import data as data_lib

  original = data_lib.load

  def load(name, split="train", data_dir=None, **kwargs):
    full = original(name, "train", data_dir, **kwargs)
    n = full.num_examples
    perm = np.random.default_rng(seed).permutation(n)
    n_val = int(round(fraction * n))
    idx = np.sort(perm[n - n_val:] if split == "test" else perm[:n - n_val])
    images, labels = full.read(idx)
    return data_lib.from_arrays(images, labels, like=full.spec, split=split)

  data_lib.load = load
  try:
    yield
  finally:
    data_lib.load = original


# ------------------------------------------------------------------------------ runs
def enable_compilation_cache() -> None:
  """JAX's persistent compilation cache, as train.py has it (FDG_JAX_COMPILATION_CACHE: a
  directory, or off; default the user-level one)."""
  from fdg_jax.runtime import compile_cache
  compile_cache.enable(os.environ.get("FDG_JAX_COMPILATION_CACHE", "auto"))


def with_fields(base, **fields):
  """A resolved copy of config `base` with `fields` set."""
  config = base.copy_and_resolve_references()
  for key, value in fields.items():
    config[key] = value
  return config


def environment() -> dict:
  """What a run's last bits depend on besides its config: the jax and jaxlib versions, the
  CPU model and the cores the process may use (XLA on the CPU splits work by them)."""
  import platform
  import jax
  import jaxlib
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "cpu": cpu, "cores": cores,
          "backend": jax.default_backend()}


def resumable_step(workdir: str, config) -> int | None:
  """The newest checkpoint's step of an interrupted run of exactly `config` in `workdir` (its
  config.json equal to `config`, with what `staleness=auto` sets, field for field), else None."""
  from fdg_jax import trainer
  try:
    with open(os.path.join(workdir, "config.json")) as f:
      saved = json.load(f)
    steps = [int(p) for p in os.listdir(os.path.join(workdir, trainer.CHECKPOINT_DIR))
             if p.isdigit()]
  except (OSError, ValueError):
    return None
  if config.get("staleness", "none") == "auto":  # the trainer writes what auto set
    config = with_fields(config, **trainer.auto_fields(config)[0])
  if not steps or saved != json.loads(config.to_json_best_effort()):
    return None
  return max(steps)


def run_one(base, workroot: str, name: str, resume: bool = False, clear: bool = True,
            **fields) -> dict:
  """One `train_and_evaluate` run of `base` with `fields` changed; returns its record.

  With `resume`, a run of exactly this config left in the workdir by an interrupted process
  goes on from its newest checkpoint (the trainer's resume is bitwise exact) and the record
  says from which step (`resumed_from_step`; its `wall_time` goes on from the checkpoint's,
  so the time lost between that checkpoint and the interruption is not counted). Any
  other workdir content is removed first (unless not `clear`: the processes of a
  multi-process run, whose launcher cleared it): a run never resumes with other settings."""
  from fdg_jax import trainer
  enable_compilation_cache()

  config = with_fields(base, **fields)
  config.progress_bar = False
  workdir = os.path.join(workroot, name)
  resumed = resumable_step(workdir, config) if resume else None
  if resumed is None and clear:
    shutil.rmtree(workdir, ignore_errors=True)
  record = {"name": name, "algorithm": config.algorithm, "num_stages": config.num_stages,
            "beta": config.beta, "seed": config.seed, "learning_rate": config.learning_rate,
            "momentum": config.momentum, "backward": config.backward, "diverged": False}
  if resumed is not None:
    record["resumed_from_step"] = resumed
  start = time.time()
  try:
    result = trainer.train_and_evaluate(config, workdir)
    record.update(test_accuracy=result["test_accuracy"], test_loss=result["test_loss"],
                  wall_time=result["wall_time"])
    if "test_loss_se" in result:
      record["test_loss_se"] = result["test_loss_se"]
  except trainer.DivergedError as e:
    record.update(diverged=True, error=str(e), test_accuracy=float("nan"),
                  test_loss=float("nan"), wall_time=time.time() - start)
  path = os.path.join(workdir, trainer.METRICS_FILE)
  curve = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          if "test_accuracy" not in r:  # a training-loss or telemetry row
            continue
          curve.append({k: r[k] for k in ("epoch", "test_accuracy", "test_loss", "train_loss",
                                          "wall_time")})
          curve[-1].update({k: r[k] for k in ("step", "test_loss_se") if k in r})
  record["curve"] = curve
  record["env"] = environment()
  print(f"  {name:40s} acc {record['test_accuracy']:.4f}  wall {record['wall_time']:6.1f} s"
        + ("  DIVERGED" if record["diverged"] else ""), flush=True)
  return record


def select_beta(base, workroot, k: int, betas, fraction: float) -> tuple[float, list]:
  """beta for FDG at K=k by final validation accuracy on a held-out part of train (seed 0)."""
  rows = []
  with validation_split(fraction):
    for beta in betas:
      r = run_one(base, workroot, f"val_fdg_k{k}_beta{beta:g}", algorithm="fdg", num_stages=k,
                  beta=float(beta), seed=0)
      rows.append({"num_stages": k, "beta": float(beta), "val_accuracy": r["test_accuracy"],
                   "val_loss": r["test_loss"], "diverged": r["diverged"]})
  ok = [r for r in rows if not r["diverged"]] or rows
  best = max(ok, key=lambda r: (_num(r["val_accuracy"]), -_num(r["val_loss"], big=True),
                                r["beta"]))
  return best["beta"], rows


def _num(v, big=False):
  """NaN-safe sort key: NaN -> -inf (or +inf when `big`)."""
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return math.inf if big else -math.inf
  return v


# ------------------------------------------------------------------------------ summaries
def summarize(runs: list[dict], group_of) -> list[dict]:
  """mean/std of final test accuracy and wall time per group (in first-seen order)."""
  groups: dict = {}
  for r in runs:
    groups.setdefault(group_of(r), []).append(r)
  rows = []
  for label, rs in groups.items():
    accs = [r["test_accuracy"] for r in rs if not r["diverged"]]
    walls = [r["wall_time"] for r in rs]
    rows.append({
        "method": label, "runs": len(rs), "diverged": sum(r["diverged"] for r in rs),
        "test_accuracy_mean": statistics.fmean(accs) if accs else float("nan"),
        "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "test_accuracy_min": min(accs) if accs else float("nan"),
        "wall_time_mean": statistics.fmean(walls),
        "wall_time_std": statistics.stdev(walls) if len(walls) > 1 else 0.0,
        "seeds": [r["seed"] for r in rs],
    })
  return rows


def markdown_table(rows: list[dict], bp_mean: float | None) -> str:
  lines = ["| method | runs | test accuracy % (mean ± std) | min % | Δ vs BP (points) | "
           "wall time s (mean ± std) |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    m, s = 100 * r["test_accuracy_mean"], 100 * r["test_accuracy_std"]
    delta = "" if bp_mean is None or math.isnan(m) else f"{m - 100 * bp_mean:+.2f}"
    div = f" ({r['diverged']} diverged)" if r["diverged"] else ""
    lines.append(f"| {r['method']} | {r['runs']}{div} | {m:.2f} ± {s:.2f} | "
                 f"{100 * r['test_accuracy_min']:.2f} | {delta} | "
                 f"{r['wall_time_mean']:.1f} ± {r['wall_time_std']:.1f} |")
  return "\n".join(lines)


def beta_table(rows: list[dict], chosen: dict) -> str:
  lines = ["| K | β | validation accuracy % | validation loss | chosen |", "|---|---|---|---|---|"]
  for r in rows:
    mark = "✓" if chosen.get(str(r["num_stages"])) == r["beta"] else ""
    lines.append(f"| {r['num_stages']} | {r['beta']:g} | {100 * r['val_accuracy']:.2f} | "
                 f"{r['val_loss']:.4f} | {mark} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------ plot
def plot(result: dict, output: str) -> None:
  """Three panels: the study's test accuracy against epoch (mean over seeds per method); the
  side experiment's final test accuracy per seed against lr (x: diverged); and its per-seed
  curves at the middle lr."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  runs = result["runs"]
  side = [r for r in runs if r["part"] == "side"]
  fig, axes = plt.subplots(1, 3 if side else 1, figsize=(14, 4) if side else (5.5, 4),
                           squeeze=False)
  axes = axes[0]
  ax = axes[0]
  groups: dict = {}
  for r in runs:
    if r["part"] == "study":
      groups.setdefault(r["method"], []).append(r)
  for label, rs in groups.items():
    curves = [r["curve"] for r in rs if r["curve"]]
    if not curves:
      continue
    n = min(len(c) for c in curves)
    acc = np.mean([[c["test_accuracy"] for c in cur[:n]] for cur in curves], axis=0)
    style = "-" if label.startswith("BP") else ("--" if "K=2" in label else ":")
    ax.plot([c["epoch"] for c in curves[0][:n]], 100 * acc, style, label=label, lw=1.5)
  ax.set_title("study (quick-start settings: momentum 0.5, lr 0.05)", fontsize=9)
  ax.set_xlabel("epoch")
  ax.set_ylabel(f"test accuracy %, mean of {len(result['seeds'])} seeds")
  ax.set_ylim(85, 100)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="lower right")

  if side:
    methods = list(dict.fromkeys(r["method"].split(" lr=")[0] for r in side))
    lrs = sorted({r["learning_rate"] for r in side})
    ax = axes[1]
    for i, method in enumerate(methods):
      for j, lr in enumerate(lrs):
        rs = [r for r in side if r["method"].split(" lr=")[0] == method
              and r["learning_rate"] == lr]
        xs = j + (i - (len(methods) - 1) / 2) * 0.22 + np.linspace(-0.04, 0.04, len(rs))
        ok = [not r["diverged"] for r in rs]
        ys = [100 * r["test_accuracy"] if not r["diverged"] else 0.0 for r in rs]
        ax.scatter([x for x, o in zip(xs, ok) if o], [y for y, o in zip(ys, ok) if o],
                   color=f"C{i}", s=18, label=method if j == 0 else None)
        ax.scatter([x for x, o in zip(xs, ok) if not o], [0.0 for o in ok if not o],
                   color=f"C{i}", marker="x", s=30)
    ax.set_xticks(range(len(lrs)), [f"lr {lr:g}" for lr in lrs])
    ax.set_ylim(-5, 102)
    ax.set_ylabel("final test accuracy % (each seed; x = diverged)")
    ax.set_title("side: SGD momentum 0.9, final accuracy", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left")

    ax = axes[2]
    mid = lrs[len(lrs) // 2]
    for i, method in enumerate(methods):
      for r in side:
        if r["method"].split(" lr=")[0] == method and r["learning_rate"] == mid and r["curve"]:
          ax.plot([c["epoch"] for c in r["curve"]],
                  [100 * c["test_accuracy"] for c in r["curve"]], color=f"C{i}", lw=1,
                  label=method if r["seed"] == result["seeds"][0] else None)
          if r["diverged"]:
            ax.plot(r["curve"][-1]["epoch"], 100 * r["curve"][-1]["test_accuracy"], "x",
                    color=f"C{i}")
    ax.set_title(f"side: momentum 0.9, lr {mid:g}, every seed", fontsize=9)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
  fig.tight_layout()
  fig.savefig(output, dpi=80)
  plt.close(fig)


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "configs" / "default.py"))
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="override a config field, e.g. --set num_epochs=5 (repeatable)")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--betas", type=float, nargs="+", default=[1.0, 0.8, 0.5, 0.2],
                      help="FDG betas searched on the validation split (seed 0)")
  parser.add_argument("--val_fraction", type=float, default=0.2)
  parser.add_argument("--side_lrs", type=float, nargs="*", default=[0.01, 0.05, 0.1],
                      help="learning rates of the momentum-0.9 side experiment (none: skip)")
  parser.add_argument("--side_momentum", type=float, default=0.9)
  parser.add_argument("--side_betas", type=float, nargs="+", default=[1.0, 0.5],
                      help="FDG betas of the side experiment")
  parser.add_argument("--side_stages", type=int, default=4)
  parser.add_argument("--workdir", default=str(ROOT / "runs" / "parity"))
  parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "parity.json"))
  parser.add_argument("--plot", default=str(ROOT / "docs" / "results" / "parity.png"))
  parser.add_argument("--plot_only", action="store_true",
                      help="only redraw --plot from an existing --out")
  args = parser.parse_args(argv)

  if args.plot_only:
    with open(args.out) as f:
      plot(json.load(f), args.plot)
    print(f"wrote {args.plot}")
    return 0

  base = apply_overrides(load_config(args.config), args.set)
  # The forced CPU devices must exist before JAX starts (no-op on GPUs, or if it has started).
  with contextlib.suppress(Exception):
    import jax
    jax.config.update("jax_num_cpu_devices", int(base.num_cpu_devices))
  import jax

  started = time.time()
  print(f"devices: {jax.devices()}", flush=True)
  print("1. beta selection on a validation split of the training data (seed 0)", flush=True)
  chosen, search = {}, []
  for k in args.stages:
    chosen[str(k)], rows = select_beta(base, args.workdir, k, args.betas, args.val_fraction)
    search += rows

  print("2. the study", flush=True)
  runs = []

  def add(part, method, name, **fields):
    r = run_one(base, args.workdir, name, **fields)
    r.update(part=part, method=method)
    runs.append(r)

  for seed in args.seeds:
    add("study", "BP K=1", f"bp_k1_s{seed}", algorithm="bp", num_stages=1, seed=seed)
    for k in args.stages:
      add("study", f"DDG K={k}", f"ddg_k{k}_s{seed}", algorithm="ddg", num_stages=k,
          seed=seed)
      add("study", method_label("fdg", k, 1.0), f"fdg_k{k}_beta1_s{seed}", algorithm="fdg",
          num_stages=k, beta=1.0, seed=seed)
      b = chosen[str(k)]
      if b != 1.0:
        add("study", method_label("fdg", k, b), f"fdg_k{k}_beta{b:g}_s{seed}",
            algorithm="fdg", num_stages=k, beta=b, seed=seed)

  if args.side_lrs:
    print(f"3. side experiment: SGD momentum {args.side_momentum:g}", flush=True)
    K, m = args.side_stages, args.side_momentum
    for lr in args.side_lrs:
      for seed in args.seeds:
        tag = f"m{m:g}_lr{lr:g}_s{seed}"
        add("side", f"BP K=1 m={m:g} lr={lr:g}", f"bp_k1_{tag}", algorithm="bp",
            num_stages=1, seed=seed, learning_rate=lr, momentum=m)
        for beta in args.side_betas:
          add("side", f"FDG K={K} β={beta:g} m={m:g} lr={lr:g}",
              f"fdg_k{K}_beta{beta:g}_{tag}", algorithm="fdg", num_stages=K, beta=beta,
              seed=seed, learning_rate=lr, momentum=m)

  # Table order: BP, then by K: DDG, FDG beta=1, FDG selected beta (the order they ran in).
  study = summarize([r for r in runs if r["part"] == "study"], lambda r: r["method"])
  first_seen = [r["method"] for r in runs]
  study.sort(key=lambda row: (row["method"] != "BP K=1", row["method"].split("K=")[1][:1],
                              first_seen.index(row["method"])))
  side = summarize([r for r in runs if r["part"] == "side"], lambda r: r["method"])
  bp = next((r["test_accuracy_mean"] for r in study if r["method"] == "BP K=1"), None)
  gaps = {row["method"]: 100 * (row["test_accuracy_mean"] - bp) for row in study
          if bp is not None and row["method"] != "BP K=1"}

  result = {
      "description": "final test accuracy of BP/DDG/FDG on digits, base config "
                     f"{os.path.relpath(args.config, ROOT)}; see benchmarks/parity.py",
      "config": json.loads(base.to_json_best_effort()),
      "overrides": args.set,
      "seeds": args.seeds,
      "devices": [str(d) for d in jax.devices()],
      "beta_search": {"betas": args.betas, "val_fraction": args.val_fraction,
                      "criterion": "final validation accuracy (held-out 20% of train, seed 0)",
                      "rows": search, "chosen": chosen},
      "summary": study,
      "side_summary": side,
      "gap_vs_bp_points": gaps,
      "runs": runs,
      "total_time_s": time.time() - started,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1, allow_nan=True)
  if args.plot:
    plot(result, args.plot)

  print("\nbeta selection (validation split, seed 0):\n" + beta_table(search, chosen))
  print("\nstudy:\n" + markdown_table(study, bp))
  if side:
    print("\nside experiment:\n" + markdown_table(side, None))
  print(f"\nwrote {args.out}" + (f" and {args.plot}" if args.plot else "")
        + f" in {result['total_time_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
