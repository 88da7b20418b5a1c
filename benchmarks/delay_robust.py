"""Delay-robust optimisation: which optimiser and remedy keep BP's quality under DDG and FDG.

    python benchmarks/delay_robust.py --part vit          # ~1 h on 2 CPU cores
    python benchmarks/delay_robust.py --part gpt          # one epoch of 1 MB: ~1.5 h, pruned
    python benchmarks/delay_robust.py --part gpt --gpt_epochs 3 ...  # the GPT study: ~5.5 h
    python benchmarks/delay_robust.py --part mlp          # ~1 h
    python benchmarks/delay_robust.py --part vit --report  # tables from the saved runs only
                                                           # (under the options they ran with)

Workloads (each `fdg_jax.trainer.train_and_evaluate` on a config of this repository):
  gpt  configs/lm.py at width 64: token embedding, 6 causal pre-norm blocks of 4 heads, head
       (8 blocks); sequences of 64 bytes, batch 32, --gpt_epochs over the first 1 MB of the
       corpus's training split; score: validation loss per byte (perplexity = exp).
  vit  ViT on digits (patch 2: 16 tokens, width 64, 6 blocks of 4 heads; 8 blocks), batch 32,
       --vit_epochs, cosine with a 1-epoch warm-up; score: accuracy.
  mlp  MLP of 7 hidden blocks of --mlp_width and a head (8 blocks) on digits, SGD momentum 0.9,
       30 epochs; score: accuracy.
Schedules: BP (K=1), DDG and FDG at K=4 and K=8 (balanced splits, beta 1 unless a remedy sets
it). Optimisers (Adam-family workloads, weight decay 0 for all): adamw (lr 1e-3), muon (lr
0.02 on matrices, Adam at 1e-3 on the rest), basis_rotation (lr 1e-3, bases every 10 steps),
nadam_warmup (PipeNAG's NAdam, b1 0.99, lr 1e-3); each lr is a base scaled by the grid.

Protocol (successive halving; every choice on a held-out part of the training split, seed 0,
never on the split reported):
  1. screen: every optimiser at BP and FDG K=8, each lr multiplier of --lrs;
  2. the K=8 finalists (the --finalists optimisers with the best validation score at FDG K=8,
     plus AdamW as the reference when screened): DDG K=4, FDG K=4 and DDG K=8 over the same lr
     grid; then
     each remedy of REMEDIES at FDG K=4 and K=8 (and DDG K=8) at that cell's chosen lr;
  2b. (--settings) the optimiser settings of SETTINGS (b1, warm-up, a per-stage warm-up) on top
     of every finalist cell's choice, BP included, by forward selection: each round adds the
     setting that most improves the held-out score, until none does;
  3. test: every cell's chosen setting with each seed of --seeds, on the test split (gpt: the
     corpus's validation files; images: the test split).
Wherever a cell's best lr multiplier sits at the grid's edge, the grid grows past it (x2 or /2,
up to --extend steps a side) before the choice is made.
The held-out part: digits, 20% of the training split (fixed permutation); text, the training
split's bytes after the first 1 MB (other files than those trained on).
mlp: the optimiser is SGD momentum 0.9 (no screen); the lr grid and the remedies run at every
delayed schedule; --mlp_width and --mlp_lr give the robustness runs' settings.

Every run's record is saved under --workdir and into the part's JSON as it finishes; a rerun
reuses them (so a part can be stopped and resumed, on another machine too: the JSON alone
suffices; --resume_from adds other JSONs' records), and --report prints the tables without
training. Writes docs/results/delay_robust_<part>.json and prints markdown tables: per
optimiser the delay's cost (each schedule against BP with the same optimiser), and the headline
(the best delayed run per schedule against the best BP run).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity import ROOT, load_config, run_one, validation_split  # noqa: E402

SCHEDULES = {"BP": {"algorithm": "bp", "num_stages": 1},
             "DDG K=4": {"algorithm": "ddg", "num_stages": 4},
             "FDG K=4": {"algorithm": "fdg", "num_stages": 4},
             "DDG K=8": {"algorithm": "ddg", "num_stages": 8},
             "FDG K=8": {"algorithm": "fdg", "num_stages": 8}}
ADAM_FAMILY = {
    "adamw": {"optimizer": "adamw", "learning_rate": 1e-3},
    "muon": {"optimizer": "muon", "learning_rate": 0.02,
             "optimizer_kwargs": {"adam_learning_rate": 1e-3}},
    "basis_rotation": {"optimizer": "basis_rotation", "learning_rate": 1e-3},
    "nadam_warmup": {"optimizer": "nadam_warmup", "learning_rate": 1e-3},
}
SGD = {"sgd_m0.9": {"optimizer": "sgd", "momentum": 0.9, "learning_rate": 0.03}}
# Remedies tried on the delayed schedules (at the cell's chosen lr). Config fields.
REMEDIES = {
    "adam": {
        "error_feedback 0.5": {"staleness": "error_feedback", "staleness_strength": 0.5},
        "error_feedback 1": {"staleness": "error_feedback", "staleness_strength": 1.0},
        "weight_prediction": {"staleness": "weight_prediction"},
        "weight_prediction+lr_by_delay": {"staleness": "weight_prediction+lr_by_delay",
                                          "staleness_ramp_epochs": "sixth"},
    },
    "sgd": {
        "beta 0.5": {"beta": 0.5},
        "lr_by_delay": {"staleness": "lr_by_delay", "staleness_ramp_epochs": -1.0},
        "spike_compensation+lr_by_delay": {"staleness": "spike_compensation+lr_by_delay",
                                           "staleness_ramp_epochs": -1.0},
        "spike_compensation+lr_by_delay, beta 0.5": {
            "staleness": "spike_compensation+lr_by_delay", "staleness_ramp_epochs": -1.0,
            "beta": 0.5},
        "error_feedback 0.5": {"staleness": "error_feedback", "staleness_strength": 0.5},
        "error_feedback 0.5, beta 0.5": {"staleness": "error_feedback",
                                         "staleness_strength": 0.5, "beta": 0.5},
        "spike_compensation+weight_prediction": {
            "staleness": "spike_compensation+weight_prediction"},
        "nesterov_delay 0.9": {"staleness": "nesterov_delay", "nesterov_gamma": 0.9},
        "dc adaptive": {"staleness": "dc", "dc_adaptive": True},
    },
}
# Optimiser settings tried at every cell of the finalists, BP included (--settings), on top of
# the cell's chosen lr and remedy, by forward selection. "b1" is the first moment's decay (for
# muon: its momentum `beta` and its Adam part's `adam_b1`); "warmup" the warm-up's length in
# epochs. A setting with a "staleness" field joins the cell's remedy ("a+b") and is not tried
# under BP, where it would change nothing.
SETTINGS = {
    "adam": {"b1 0.95": {"b1": 0.95}, "b1 0.98": {"b1": 0.98}, "b1 0.99": {"b1": 0.99},
             "warmup 1": {"warmup_epochs": 1.0}, "warmup 2": {"warmup_epochs": 2.0},
             # the ViT's 15 epochs: a third and two thirds of the run, as 1 and 2 of the GPT's 3
             "warmup 5": {"warmup_epochs": 5.0}, "warmup 10": {"warmup_epochs": 10.0},
             # PipeMare's rate rule as a per-stage warm-up: stage k starts at lr / d_k and
             # reaches the base rate after one epoch (on top of the cell's remedy)
             "lr_by_delay ramp 1": {"staleness": "lr_by_delay", "staleness_ramp_epochs": 1.0}},
    "sgd": {"warmup 1": {"warmup_epochs": 1.0}},
}
JOIN = " & "  # a cell's "remedy" slot: remedy and/or setting, joined


def workload(part: str, args) -> tuple[str, dict, dict]:
  """(config file, fields common to the part's runs, optimisers)."""
  if part == "gpt":
    return str(ROOT / "configs" / "lm.py"), {
        "model_kwargs": {"seq_len": 64, "dim": 64, "depth": 6, "num_heads": 4},
        "seq_len": 64, "text_max_bytes": args.gpt_bytes, "num_epochs": args.gpt_epochs,
        "batch_size": 32, "weight_decay": 0.0, "momentum": 0.0, "split": "balanced",
        "eval_every_epochs": args.gpt_epochs}, ADAM_FAMILY
  if part == "vit":
    return str(ROOT / "configs" / "default.py"), {
        "model": "vit", "split": "balanced", "weight_decay": 0.0, "momentum": 0.0,
        "num_epochs": args.vit_epochs, "eval_every_epochs": args.vit_epochs,
        "model_kwargs": {"input_shape": (8, 8, 1), "patch_size": 2, "dim": 64, "depth": 6,
                         "num_heads": 4}}, ADAM_FAMILY
  return str(ROOT / "configs" / "default.py"), {
      "model": "mlp", "model_kwargs": {"widths": (args.mlp_width,) * 7}, "split": "uniform",
      "num_epochs": 30, "eval_every_epochs": 30}, {
          "sgd_m0.9": {**SGD["sgd_m0.9"], "learning_rate": args.mlp_lr}}


# ------------------------------------------------------------------------------ held-out data
@contextlib.contextmanager
def text_validation_split(offset: int, size: int):
  """Makes the text corpus's "validation" split the training split's bytes
  [offset, offset + size): files the run never trains on (it reads the first `offset`)."""
  from fdg_jax.data import text
  original = text.load_text

  def load(split="train", **kwargs):
    if text._check_split(split) == "train":
      return original("train", **kwargs)
    kwargs = {**kwargs, "max_bytes": offset + size}
    full = original("train", **kwargs)
    tokens = full.tokens[offset:]
    tokens.flags.writeable = False
    return text.TextDataset(**{**full.__dict__, "split": "validation", "tokens": tokens,
                               "sha256": f"{full.sha256}[{offset}:]"})

  text.load_text = load
  try:
    yield
  finally:
    text.load_text = original


def _worker(task: dict) -> dict:
  """One run in a worker process: the config, its fields, and where it is scored."""
  import ml_collections
  config = load_config(task["config"])
  fields = dict(task["fields"])
  for key in ("model_kwargs", "optimizer_kwargs"):
    if key in fields:
      config[key] = ml_collections.ConfigDict(fields.pop(key))
  if task["held_out"] == "text":
    held = text_validation_split(fields.get("text_max_bytes", 1_000_000), 250_000)
  elif task["held_out"] == "images":
    held = validation_split(0.2)
  else:
    held = contextlib.nullcontext()
  try:
    with held:
      record = run_one(config, task["workroot"], task["name"], **fields)
  except Exception as e:  # a run that cannot start counts as failed, the study goes on
    return {"name": task["name"], "diverged": True, "error": f"{type(e).__name__}: {e}",
            "test_accuracy": math.nan, "test_loss": math.nan, "wall_time": 0.0}
  record.pop("curve", None)
  return record


# ------------------------------------------------------------------------------ the protocol
class Study:
  def __init__(self, args):
    self.args = args
    self.part = args.part
    self.config, self.common, self.optimizers = workload(args.part, args)
    if args.epochs:
      self.common.update(num_epochs=args.epochs, eval_every_epochs=args.epochs,
                         warmup_epochs=min(1.0, args.epochs / 5))
    self.family = "sgd" if args.part == "mlp" else "adam"
    self.records: dict[str, dict] = {}
    self.store = pathlib.Path(args.workdir) / args.part / "records"
    self.store.mkdir(parents=True, exist_ok=True)
    self.extra: dict[tuple, set] = {}  # (optimizer, schedule) -> lr multipliers past the grid
    # The study's JSON holds every record so far (rewritten as each run ends); a rerun starts
    # from it and from --resume_from, so a study survives the loss of its --workdir.
    self.out = pathlib.Path(args.out)
    for path in [*args.resume_from, *([self.out] if self.out.exists() else [])]:
      for record in json.loads(pathlib.Path(path).read_text()).get("runs", []):
        self.records.setdefault(record["name"], record)
    self.pool = None if args.report else concurrent.futures.ProcessPoolExecutor(
        max_workers=args.jobs, mp_context=multiprocessing.get_context("spawn"))

  def save_partial(self):
    """The records so far into the study's JSON (its other fields kept until the study ends)."""
    data = json.loads(self.out.read_text()) if self.out.exists() else {"part": self.part}
    data.update(runs=list(self.records.values()), partial=True)
    tmp = self.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=True))
    os.replace(tmp, self.out)

  def score(self, r: dict) -> float:
    if r is None or r["diverged"] or r["test_loss"] is None or math.isnan(r["test_loss"]):
      return -math.inf
    if self.part == "gpt":
      return -r["test_loss"]
    return r["test_accuracy"] - 1e-3 * r["test_loss"]  # ties: lower loss

  def fields(self, optimizer: str, schedule: str, lr_mult: float, remedy: str | None,
             seed: int) -> dict:
    spec = dict(self.optimizers[optimizer])
    f = {**self.common, **SCHEDULES[schedule], **spec, "seed": seed}
    f["learning_rate"] = spec["learning_rate"] * lr_mult
    if "optimizer_kwargs" in spec:
      f["optimizer_kwargs"] = {k: v * lr_mult if k.endswith("learning_rate") else v
                               for k, v in spec["optimizer_kwargs"].items()}
    for part in (remedy.split(JOIN) if remedy else ()):
      spec = REMEDIES[self.family].get(part, SETTINGS[self.family].get(part))
      if spec is None:
        raise ValueError(f"unknown remedy or setting {part!r}")
      for key, value in spec.items():
        if value == "sixth":  # a ramp over the first sixth of training
          value = f["num_epochs"] / 6.0
        if key == "b1" and f["optimizer"] == "muon":  # muon's own names for it
          f["optimizer_kwargs"] = {**f.get("optimizer_kwargs", {}), "beta": value,
                                   "adam_b1": value}
          continue
        if key == "staleness" and f.get("staleness", "none") != "none":
          value = f"{f['staleness']}+{value}"  # a combination of the remedies
        f[key] = value
    f["staleness_ramp_epochs"] = f.get("staleness_ramp_epochs", -1.0)
    return f

  def name(self, optimizer, schedule, lr_mult, remedy, seed, held_out) -> str:
    bits = [("val" if held_out else "test"), optimizer, schedule.replace(" K=", "k").lower(),
            f"lr{lr_mult:g}", (remedy or "plain").replace(" ", "_").replace(",", ""),
            f"s{seed}"]
    return "_".join(bits)

  def run(self, cells: list[tuple], held_out: bool) -> list[dict]:
    """Runs (optimizer, schedule, lr multiplier, remedy, seed) cells; reuses saved ones."""
    todo, names = [], []
    for cell in cells:
      name = self.name(*cell, held_out)
      names.append(name)
      path = self.store / f"{name}.json"
      if name in self.records:
        continue
      if path.exists():
        self.records[name] = json.loads(path.read_text())
        continue
      if self.pool is None:
        continue
      kind = ("text" if self.part == "gpt" else "images") if held_out else None
      todo.append({"name": name, "config": self.config, "fields": self.fields(*cell),
                   "held_out": kind, "workroot": str(pathlib.Path(self.args.workdir) / self.part),
                   "cell": cell})
    futures = {self.pool.submit(_worker, t): t for t in todo} if todo else {}
    for fut in concurrent.futures.as_completed(futures):
      t = futures[fut]
      record = {**fut.result(), "cell": list(t["cell"]), "held_out": held_out}
      if self.part == "gpt" and not record["diverged"]:
        record["test_perplexity"] = math.exp(record["test_loss"])
      (self.store / f"{t['name']}.json").write_text(json.dumps(record))
      self.records[t["name"]] = record
      if not self.args.report:
        self.save_partial()
    return [self.records.get(n) for n in names]

  def grid(self, optimizer, schedule) -> list[float]:
    return sorted(set(self.args.lrs) | self.extra.get((optimizer, schedule), set()))

  def best(self, optimizer, schedule, remedies=(None,)) -> tuple:
    """The (lr multiplier, remedy) with the best validation score among those run."""
    options = [(m, r) for r in remedies for m in self.grid(optimizer, schedule)]
    rows = self.run([(optimizer, schedule, m, r, 0) for m, r in options], True)
    scored = [(self.score(row), -i, opt) for i, (row, opt) in enumerate(zip(rows, options))]
    return max(scored)[2] if scored else (1.0, None)

  def extend(self, cells) -> None:
    """Moves the lr grid of each (optimizer, schedule) past its edge while the best multiplier
    sits there (x2 above the top, /2 below the bottom), up to --extend steps a side; the new
    runs of every cell in one batch per round."""
    for _ in range(self.args.extend):
      todo = []
      for o, s in cells:
        grid, (m, _) = self.grid(o, s), self.best(o, s)
        if self.records.get(self.name(o, s, m, None, 0, True)) is None or len(grid) < 2:
          continue
        new = m * 2 if m == grid[-1] else m / 2 if m == grid[0] else None
        if new is not None and abs(math.log2(new / (self.args.lrs[-1] if new > m else
                                                     self.args.lrs[0]))) <= self.args.extend:
          self.extra.setdefault((o, s), set()).add(new)
          todo.append((o, s, new, None, 0))
      if not todo:
        return
      self.run(todo, True)

  def protocol(self) -> dict:
    a = self.args
    chosen: dict = {}
    optimizers = [o for o in self.optimizers if not a.optimizers or o in a.optimizers]
    # 1. screen: every optimiser at BP and FDG K=8 over the lr grid.
    self.run([(o, s, m, None, 0) for o in optimizers for s in ("BP", "FDG K=8")
              for m in a.lrs], True)
    self.extend([(o, s) for o in optimizers for s in ("BP", "FDG K=8")])
    for o in optimizers:
      for s in ("BP", "FDG K=8"):
        chosen[(o, s)] = self.best(o, s)
    if self.family == "sgd":
      finalists = optimizers
    else:
      k8 = sorted(optimizers, key=lambda o: -self.score(self.run(
          [(o, "FDG K=8", chosen[(o, "FDG K=8")][0], None, 0)], True)[0]))
      # AdamW is the reference finalist unless the screen was pruned to exclude it.
      finalists = list(dict.fromkeys(k8[:a.finalists] + ["adamw"] * ("adamw" in optimizers)))
    # 2. the finalists' other delayed schedules, then the remedies.
    others = [s for s in ("DDG K=4", "FDG K=4", "DDG K=8") if s in a.schedules]
    self.run([(o, s, m, None, 0) for o in finalists for s in others for m in a.lrs], True)
    self.extend([(o, s) for o in finalists for s in others])
    trials = {}  # (optimizer, schedule) -> the remedies tried there
    for o in finalists:
      for s in others:
        chosen[(o, s)] = self.best(o, s)
      if a.remedy_for and o not in a.remedy_for:
        continue
      for s in [s for s in a.remedy_at if s in a.schedules]:
        trials[(o, s)] = [r for r in REMEDIES[self.family]  # shrinking is FDG's
                          if ("beta" not in REMEDIES[self.family][r] or s.startswith("FDG"))
                          and (not a.remedies or r in a.remedies)]
    # All remedy runs in one batch (so every worker is busy), then each cell's choice.
    self.run([(o, s, chosen[(o, s)][0], r, 0) for (o, s), rs in trials.items() for r in rs],
             True)
    for (o, s), remedies in trials.items():
      lr = chosen[(o, s)][0]
      plain = self.run([(o, s, lr, None, 0)], True)[0]
      rows = self.run([(o, s, lr, r, 0) for r in remedies], True)
      options = [(self.score(plain), 0, (lr, None))] + [
          (self.score(row), -1 - i, (lr, r)) for i, (row, r) in enumerate(zip(rows, remedies))]
      chosen[(o, s)] = max(options)[2]
    # 2b. the optimiser's settings (--settings) on top of each finalist cell's choice, BP
    # included: forward selection, each round adding the setting that most improves the
    # held-out score (none: the cell is done); settings setting the same field do not stack.
    if a.settings:
      cells = [(o, s) for (o, s) in chosen if o in finalists and s in a.schedules
               and (not a.settings_for or o in a.settings_for)]
      spec = SETTINGS[self.family]

      def candidates(schedule, remedy):
        have = [p for p in (remedy.split(JOIN) if remedy else ()) if p in spec]
        taken = {k for p in have for k in spec[p] if k != "staleness"}
        return [st for st in a.settings if st not in have
                and not (set(spec[st]) - {"staleness"}) & taken
                and not ("staleness" in spec[st] and schedule == "BP")]

      def plus(remedy, setting):
        return setting if remedy is None else f"{remedy}{JOIN}{setting}"
      active = list(cells)
      while active:  # one batch per round: every active cell's choice and its candidates
        options = {}
        for o, s in active:
          lr, remedy = chosen[(o, s)]
          options[(o, s)] = [(lr, remedy)] + [(lr, plus(remedy, st))
                                              for st in candidates(s, remedy)]
        rows = iter(self.run([(o, s, m, r, 0) for (o, s), opts in options.items()
                              for m, r in opts], True))
        improved = []
        for (o, s), opts in options.items():
          best = max((self.score(next(rows)), -i, opt) for i, opt in enumerate(opts))[2]
          if best != opts[0]:
            chosen[(o, s)] = best
            improved.append((o, s))
        active = improved
    # 3. test every chosen setting with every seed: one batch, seed by seed (a stopped study
    # has whole seeds done rather than whole cells).
    cells = {(o, s): c for (o, s), c in chosen.items()
             if not (a.tested and o not in a.tested and s not in ("BP", "FDG K=8"))}
    self.run([(o, s, lr, remedy, seed) for seed in a.seeds
              for (o, s), (lr, remedy) in cells.items()], False)
    tests = {(o, s): {"lr_mult": lr, "remedy": remedy,
                      "rows": self.run([(o, s, lr, remedy, seed) for seed in a.seeds], False)}
             for (o, s), (lr, remedy) in cells.items()}
    return {"chosen": chosen, "tests": tests, "finalists": finalists}

  def close(self):
    if self.pool is not None:
      self.pool.shutdown()


# ------------------------------------------------------------------------------ reporting
def _stats(rows, key):
  vals = [r[key] for r in rows if r is not None and not r["diverged"]]
  if not vals:
    return math.nan, math.nan, 0
  return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0), len(vals)


def report(study: Study, result: dict) -> tuple[str, dict]:
  part = study.part
  key = "test_perplexity" if part == "gpt" else "test_accuracy"
  scale = 1.0 if part == "gpt" else 100.0
  unit = "perplexity" if part == "gpt" else "accuracy %"
  summary = {}
  for (o, s), t in result["tests"].items():
    mean, std, n = _stats(t["rows"], key)
    summary[f"{o} | {s}"] = {"optimizer": o, "schedule": s, "lr_mult": t["lr_mult"],
                             "remedy": t["remedy"], "mean": mean * scale, "std": std * scale,
                             "runs": n, "seeds": len(t["rows"]),
                             "diverged": sum(bool(r and r["diverged"]) for r in t["rows"])}
  lines = [f"### {part}: test {unit}, mean ± std over seeds (chosen lr multiplier, remedy)",
           "", "| optimizer | " + " | ".join(SCHEDULES) + " |", "|" + "---|" * (len(SCHEDULES) + 1)]
  for o in study.optimizers:
    cells = []
    for s in SCHEDULES:
      e = summary.get(f"{o} | {s}")
      if e is None:
        cells.append("–")
        continue
      tag = f" ×{e['lr_mult']:g}" + (f", {e['remedy']}" if e["remedy"] else "")
      div = f", {e['diverged']} div." if e["diverged"] else ""
      cells.append(f"{e['mean']:.2f} ± {e['std']:.2f}{div} ({tag.strip()})")
    lines.append(f"| {o} | " + " | ".join(cells) + " |")
  lines += ["", f"Held-out split (seed 0), the chosen setting of every cell ({unit}; the "
            "selection's own score, so optimistic; cells without a test row were pruned):", "",
            "| optimizer | " + " | ".join(SCHEDULES) + " |",
            "|" + "---|" * (len(SCHEDULES) + 1)]
  for o in study.optimizers:
    cells = []
    for s in SCHEDULES:
      c = result["chosen"].get((o, s))
      r = c and study.records.get(study.name(o, s, c[0], c[1], 0, True))
      if not r or r["diverged"]:
        cells.append("–" if not r else "div.")
        continue
      v = math.exp(r["test_loss"]) if part == "gpt" else 100 * r["test_accuracy"]
      cells.append(f"{v:.2f} (×{c[0]:g}" + (f", {c[1]})" if c[1] else ")"))
    if any(c != "–" for c in cells):
      lines.append(f"| {o} | " + " | ".join(cells) + " |")
  lines += ["", f"The delay's cost per optimiser (schedule minus BP with the same optimiser; "
            f"{unit}):", "", "| optimizer | " + " | ".join(list(SCHEDULES)[1:]) + " |",
            "|" + "---|" * len(SCHEDULES)]
  for o in study.optimizers:
    bp = summary.get(f"{o} | BP")
    if bp is None:
      continue
    cells = []
    for s in list(SCHEDULES)[1:]:
      e = summary.get(f"{o} | {s}")
      if e is None:
        cells.append("–")
      elif part == "gpt":
        cells.append(f"{100 * (e['mean'] / bp['mean'] - 1):+.1f}%")
      else:
        cells.append(f"{e['mean'] - bp['mean']:+.2f}")
    lines.append(f"| {o} | " + " | ".join(cells) + " |")
  def held_out_score(e):
    """The selection's own (held-out, seed 0) score of a tested cell's chosen setting: the
    headline's choices read it, never the test rows they report."""
    c = result["chosen"].get((e["optimizer"], e["schedule"]))
    r = c and study.records.get(study.name(e["optimizer"], e["schedule"], c[0], c[1], 0, True))
    return study.score(r)

  bps = [e for e in summary.values() if e["schedule"] == "BP" and e["runs"]]
  if bps:
    best_bp = max(bps, key=held_out_score)
    lines += ["", f"Headline: per schedule, the tested cell with the best held-out score, "
              f"against the BP cell with the best held-out score ({best_bp['optimizer']}, "
              f"{best_bp['mean']:.2f}); test means:", ""]
    for s in list(SCHEDULES)[1:]:
      es = [e for e in summary.values() if e["schedule"] == s and e["runs"]]
      if not es:
        continue
      e = max(es, key=held_out_score)
      gap = (f"{100 * (e['mean'] / best_bp['mean'] - 1):+.1f}%" if part == "gpt"
             else f"{e['mean'] - best_bp['mean']:+.2f} points")
      lines.append(f"- {s}: {e['optimizer']}" + (f" + {e['remedy']}" if e["remedy"] else "")
                   + f" {e['mean']:.2f} ± {e['std']:.2f} ({gap})")
  return "\n".join(lines), summary


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", required=True, choices=("gpt", "vit", "mlp"))
  parser.add_argument("--lrs", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                      help="learning-rate multipliers of each optimiser's base")
  parser.add_argument("--finalists", type=int, default=2)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--gpt_epochs", type=int, default=1)
  parser.add_argument("--vit_epochs", type=int, default=15)
  parser.add_argument("--mlp_width", type=int, default=96)
  parser.add_argument("--mlp_lr", type=float, default=0.03)
  parser.add_argument("--epochs", type=int, default=0,
                      help="override every run's epochs (0: the part's own; for a smoke run)")
  parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES),
                      help="prune: the schedules run (BP and FDG K=8 always)")
  parser.add_argument("--optimizers", nargs="+", default=[],
                      help="prune: the optimisers screened (default: all of the part's)")
  parser.add_argument("--remedy_at", nargs="+", default=["FDG K=4", "FDG K=8", "DDG K=8"],
                      choices=list(SCHEDULES)[1:], help="prune: schedules where remedies run")
  parser.add_argument("--remedy_for", nargs="+", default=[],
                      help="prune: finalists whose remedies run (default: every finalist)")
  parser.add_argument("--remedies", nargs="+", default=[],
                      help="prune: the remedies tried (names of REMEDIES; default: all)")
  parser.add_argument("--tested", nargs="+", default=[],
                      help="prune: finalists tested at every schedule (default: all); the "
                           "others are tested at BP and FDG K=8, their other cells reported "
                           "on the held-out split only")
  parser.add_argument("--settings", nargs="+", default=[],
                      help="optimiser settings tried at every finalist cell, BP included, by "
                           "forward selection (names of SETTINGS, e.g. 'b1 0.98' 'warmup 1'; "
                           "default: none)")
  parser.add_argument("--settings_for", nargs="+", default=[],
                      help="prune: finalists whose cells try --settings (default: every one)")
  parser.add_argument("--extend", type=int, default=2,
                      help="steps (x2 or /2) the lr grid may grow past an edge where a cell's "
                           "best multiplier sits (0: the grid as given)")
  parser.add_argument("--resume_from", nargs="+", default=[],
                      help="JSON files of earlier runs of the study whose records are reused "
                           "(the part's own JSON always is)")
  parser.add_argument("--gpt_bytes", type=int, default=1_000_000,
                      help="gpt: training bytes (the held-out part follows them)")
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--report", action="store_true", help="tables from saved runs only")
  parser.add_argument("--markdown", action="store_true",
                      help="with --report: print only the headline, as the docs hold it")
  parser.add_argument("--workdir", default=str(ROOT / "runs" / "delay_robust"))
  parser.add_argument("--out", default="")
  return parser


def main(argv=None) -> int:
  parser = make_parser()
  args = parser.parse_args(argv)
  args.schedules = list(dict.fromkeys(["BP", "FDG K=8", *args.schedules]))
  # A variant of a part's workload keeps its own records and JSON (the records' names do not
  # carry the workload's size).
  variant = ""
  if args.part == "mlp" and (args.mlp_width != 96 or args.mlp_lr != 0.03):
    variant = f"w{args.mlp_width}_lr{args.mlp_lr:g}"
  elif args.part == "gpt" and (args.gpt_bytes != 1_000_000 or args.gpt_epochs != 1):
    variant = "_".join(([f"b{args.gpt_bytes}"] if args.gpt_bytes != 1_000_000 else [])
                       + ([f"e{args.gpt_epochs}"] if args.gpt_epochs != 1 else []))
  if variant:
    args.workdir = os.path.join(args.workdir, variant)
  args.out = args.out or str(ROOT / "docs" / "results" /
                             f"delay_robust_{args.part}{'_' + variant if variant else ''}.json")
  unknown = [x for x in args.settings
             if x not in SETTINGS["sgd" if args.part == "mlp" else "adam"]]
  if unknown:
    parser.error(f"unknown --settings {unknown}; known: "
                 f"{list(SETTINGS['sgd' if args.part == 'mlp' else 'adam'])}")
  if args.report and os.path.exists(args.out):
    # The report follows the protocol options the part's runs were made under (its JSON's
    # args), not this command line's defaults.
    saved = json.loads(pathlib.Path(args.out).read_text()).get("args", {})
    for key, value in saved.items():
      if key not in ("report", "workdir", "out", "jobs", "resume_from") and hasattr(args, key):
        setattr(args, key, value)
  started = time.time()
  study = Study(args)
  try:
    result = study.protocol()
  finally:
    study.close()
  text, summary = report(study, result)
  if args.markdown:
    other = [f"--{k} {getattr(args, k):g}" for k in ("mlp_width", "mlp_lr")
             if args.part == "mlp" and getattr(args, k) != parser.get_default(k)]
    command = " ".join(["python benchmarks/delay_robust.py", "--part", args.part, *other]
                       + ([f"--gpt_epochs {args.gpt_epochs}"] if args.part == "gpt"
                          and args.gpt_epochs != 1 else [])
                       + ["--report", "--markdown"])
    print(f"<!-- {command} -->\n" + ("Headline:" + text.split("Headline:", 1)[1]
                                       if "Headline:" in text else "(no headline)"))
    return 0
  print(text)
  out = args.out
  if not args.report:
    with open(out, "w") as f:
      json.dump({"part": args.part, "args": {k: v for k, v in vars(args).items()},
                 "finalists": result["finalists"],
                 "chosen": {f"{o} | {s}": list(c) for (o, s), c in result["chosen"].items()},
                 "summary": summary, "runs": list(study.records.values()),
                 "total_time_s": time.time() - started}, f, indent=1, allow_nan=True)
    print(f"wrote {out} in {time.time() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
