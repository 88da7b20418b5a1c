"""Time to BP's quality under DDG and FDG, by a protocol fixed in a file before the runs.

    python benchmarks/time_to_quality.py --part fashion_mlp             # runs, then the report
    python benchmarks/time_to_quality.py --part fashion_mlp --report    # the report only
    python benchmarks/time_to_quality.py --part fashion_mlp --report --markdown  # docs' tables
    python benchmarks/time_to_quality.py --part gpt_long --status   # progress, next runs

The protocol (benchmarks/protocols/time_to_quality.json: the grids, the edge rule, the
remedies per schedule, the tie rule, the seeds, what was pruned) governs every run; each
record stores the protocol part's sha256, the full config it ran with and a key over that
config, and the report refuses records made under another version of the part.

Choices read held-out records only (a part of the training split, the selection seed): a
schedule's learning-rate multiplier, then its remedy. A multiplier other than the base, or a
remedy, is chosen only when it beats the base or the plain run by more than the held-out
standard error; a tie goes to the simpler setting. The report then reads the test records
(the whole training split, the test seeds, the test split evaluated every epoch) and prints,
per schedule: the equal-step gap to BP, the step overhead to reach BP's final test accuracy
(from a run horizon_factor times longer), and the predicted time-to-quality speed-up
(the speed-up model's throughput for that K over the step overhead). Writes
docs/results/time_to_quality_<part>.json (every record) and, with --plot, a PNG of the test
curves against steps.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import fcntl
import hashlib
import json
import math
import multiprocessing
import os
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity import ROOT, load_config, run_one, validation_split, with_fields  # noqa: E402

PROTOCOL = ROOT / "benchmarks" / "protocols" / "time_to_quality.json"


JOIN = " & "  # two remedy candidates run together (round 2 of the remedies)


class ProtocolError(Exception):
  """Records or arguments that do not belong to the protocol's part."""


class RunFailed(ProtocolError):
  """A run that ended in an error other than a non-finite loss (a missing dataset, a bad
  config, a full disk): an infrastructure failure, never a record."""


def load_protocol(path=PROTOCOL) -> dict:
  return json.loads(pathlib.Path(path).read_text())


# Keys of a selection part that judge its results and train nothing: not in its version.
REPORT_ONLY = ("targets", "targets_source")


def part_sha256(protocol: dict, part: str) -> str:
  """The version of a part: what its runs train (its spec less REPORT_ONLY) and the shared
  rules, canonically serialised."""
  spec = {k: v for k, v in protocol["parts"][part].items() if k not in REPORT_ONLY}
  body = {"name": protocol["name"], "version": protocol["version"], "rules": protocol["rules"],
          "part": spec}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def config_key(fields: dict) -> str:
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------ the runs
def _config_and_fields(task: dict):
  """The task's base config (its nested fields set) and the flat fields `run_one` applies."""
  import ml_collections
  config = load_config(str(ROOT / task["config"]))
  fields = copy.deepcopy(task["fields"])
  for key in ("model_kwargs", "optimizer_kwargs"):
    if key in fields:
      value = fields.pop(key)
      if key == "model_kwargs" and "widths" in value:
        value["widths"] = tuple(value["widths"])
      config[key] = ml_collections.ConfigDict(value)
  return config, fields


def _candidate(what: str) -> str:
  """A run's candidate from its `what`: the schedule, lr and remedy, without the split,
  seed or length ("held_out FDG K=4 lr x1 auto seed 0" -> "FDG K=4 lr x1 auto")."""
  return re.sub(r" seed \d+| x?[\d.]+ epochs", "", what).split(" ", 1)[1]


def trained_fields(fields: dict, record: dict) -> dict:
  """A run's config fields as it trained: staleness=auto replaced by what it set (the
  record's auto_resolved, over the task's fields, as the trainer's resolve_auto does)."""
  out = dict(fields)
  if out.get("staleness") == "auto":
    out.update(record["auto_resolved"])
  return out


def trains_now(task: dict) -> dict:
  """The fields a task trains with the library as it is now (staleness=auto resolved)."""
  return {**task["fields"], **(auto_resolution(task) or {})}


def auto_resolution(task: dict) -> dict | None:
  """What `staleness=auto` sets for a task that runs it (the library's table now), else None.
  A record stores it: the config key names "auto", not what auto meant when it ran."""
  if task["fields"].get("staleness") != "auto":
    return None
  from fdg_jax import trainer
  config, fields = _config_and_fields(task)
  return trainer.auto_fields(with_fields(config, **fields))[0]


def _worker(task: dict) -> dict:
  """One training run in a worker process; its record with the per-epoch curve (and, for a
  run of staleness=auto, what auto set)."""
  config, fields = _config_and_fields(task)
  resolved = auto_resolution(task)
  commit = _code_commit()  # the code this run imports, before any later edit
  if task["split"] != "held_out":
    held = _nothing()
  elif "text_offset" in task["held_out"]:  # the training bytes after those trained on
    from delay_robust import text_validation_split
    held = text_validation_split(task["held_out"]["text_offset"], task["held_out"]["text_bytes"])
  else:
    held = validation_split(task["held_out"]["fraction"], task["held_out"]["seed"])
  # One process at a time per run directory: a second run of the same key (another study's
  # process on the same workdir, say) waits. A run an interrupted study left goes on from its
  # newest checkpoint when its config.json is this config (the resume is bitwise exact).
  lock = open(pathlib.Path(task["workroot"]) / f"{task['key']}.lock", "w")
  fcntl.flock(lock, fcntl.LOCK_EX)
  try:
    with held:
      record = run_one(config, task["workroot"], task["key"], resume=True, **fields)
  except Exception as e:  # noqa: BLE001  not a training result: the study stops on it
    line = " ".join(str(e).split()) or type(e).__name__
    raise RunFailed(f"{task['what']} failed: {type(e).__name__}: {line}; no record was "
                    "kept") from None
  finally:
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    _exit_if_orphaned()
  if resolved is not None:
    record["auto_resolved"] = resolved
  record["code_commit"] = commit
  return record


def _code_commit() -> str:
  import ttq_recipe
  return ttq_recipe.code_commit()


_PARENT: dict[str, int] = {}  # the study process of a pool worker (`_die_with_parent`)


def _exit_if_orphaned() -> None:
  """A pool worker whose study process is gone ends here: its run has saved its checkpoint
  (a stopped run does on SIGTERM) and no one is left to take the record or give it work."""
  if "pid" in _PARENT and os.getppid() != _PARENT["pid"]:
    os._exit(0)


def _die_with_parent() -> None:
  """A worker ends when the study's process does (Linux), not training on as an orphan:
  SIGTERM stops its run at a checkpoint, then `_exit_if_orphaned` ends the process."""
  _PARENT["pid"] = os.getppid()
  try:
    import ctypes
    import signal
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def pending(tasks: list[dict], records: dict) -> list[dict]:
  """The tasks without a record, each config once (two cells can ask for the same run: a
  horizon h's long run is horizon 2h's equal run), shortest first: the records of a batch are
  independent of its order, and the short runs complete whole cells of the report soonest."""
  todo = {t["key"]: t for t in tasks if t["key"] not in records}
  return sorted(todo.values(), key=lambda t: float(t["fields"].get("num_epochs", 0)))


class Runner:
  """Trains runs in a pool of worker processes, keeping every record in the part's JSON."""

  def __init__(self, out: pathlib.Path, workroot: pathlib.Path, jobs: int):
    self.out, self.workroot, self.jobs = out, workroot, jobs
    self.records = json.loads(out.read_text())["records"] if out.exists() else {}
    self.pool = None

  def __call__(self, tasks: list[dict]) -> None:
    todo = pending(tasks, self.records)
    if not todo:
      return
    if self.pool is None:
      self.workroot.mkdir(parents=True, exist_ok=True)
      self.pool = concurrent.futures.ProcessPoolExecutor(
          self.jobs, mp_context=multiprocessing.get_context("spawn"),
          initializer=_die_with_parent)
    futures = {self.pool.submit(_worker, {**t, "workroot": str(self.workroot)}): t for t in todo}
    failed = None
    for fut in concurrent.futures.as_completed(futures):
      t = futures[fut]
      if fut.cancelled():
        continue
      error = fut.exception()
      if error is not None:  # the others that run finish and are kept; no more start
        failed = failed or error
        for other in futures:
          other.cancel()
        continue
      self.records[t["key"]] = {"code_commit": _code_commit(), **fut.result(),
                                "key": t["key"], "split": t["split"],
                                "what": t["what"], "fields": t["fields"],
                                "protocol_sha256": t["protocol_sha256"]}
      self.save()
    if failed is not None:
      raise failed if isinstance(failed, ProtocolError) else RunFailed(
          f"a run's process failed: {type(failed).__name__}: {failed}")

  def save(self) -> None:
    data = json.loads(self.out.read_text()) if self.out.exists() else {}
    data["records"] = self.records
    tmp = self.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=True))
    tmp.replace(self.out)

  def close(self) -> None:
    if self.pool is not None:
      self.pool.shutdown()


class ReadOnly:
  """The records of a finished part (--report): a run not among them is an error."""

  def __init__(self, records: dict):
    self.records = records

  def __call__(self, tasks):
    missing = [t["what"] for t in tasks if t["key"] not in self.records]
    if missing:
      raise ProtocolError(f"{len(missing)} run(s) of the protocol have no record, e.g. "
                          f"{missing[0]}; run the part without --report first")


class Pending(Exception):
  """Raised by `Planner` at the first batch of runs the protocol needs and has no record of."""

  def __init__(self, tasks: list[dict]):
    super().__init__(f"{len(tasks)} run(s) pending")
    self.tasks = tasks


class Planner:
  """The records so far (--status): stops at the first batch of runs without a record, so
  the study's progress is known without training anything or reading a score it should not."""

  def __init__(self, records: dict):
    self.records = records

  def __call__(self, tasks):
    missing = pending(tasks, self.records)
    if missing:
      raise Pending(missing)


def task_steps(spec: dict, task: dict) -> int | None:
  """Training steps of a task where the part's data fixes them (text parts), else None."""
  if "text_max_bytes" not in spec["fields"]:
    return None
  return text_steps_per_epoch(spec) * int(task["fields"]["num_epochs"])


def status(study: "Study") -> str:
  """Where a part stands: its records under this version, the choices made so far (held-out
  only), and the next batch of runs the protocol needs, with their steps where known."""
  records = [r for r in study.records.values() if r.get("protocol_sha256") == study.sha]
  other = len(study.records) - len(records)
  counts = {s: sum(r["split"] == s for r in records) for s in ("held_out", "test")}
  lines = [f"part {study.part}: {counts['held_out']} held-out and {counts['test']} test "
           f"record(s) under this protocol version"
           + (f" ({other} of another version, ignored)" if other else "")]
  pending = None
  try:
    study.select()
    study.test()
  except Pending as e:
    pending = e.tasks
  phase = "selection" if len(study.chosen) < len(study.spec["schedules"]) else "test"
  if study.stale_auto():
    lines.append(f"  {len(study.stale_auto())} staleness=auto record(s) made under another auto "
                 "table: the report reads them as what they ran; more runs of their candidates "
                 "need them rerun")
  for schedule, c in study.chosen.items():
    lines.append(f"  chosen {schedule}: lr x{c['lr_mult']:g}, {c['remedy'] or 'no remedy'}")
  lines += [f"  tie: {line}" for line in study.log]
  if pending is None:
    lines.append("complete: every run the protocol needs has a record; --report prints it")
    return "\n".join(lines)
  steps = [task_steps(study.spec, t) for t in pending]
  known = None if None in steps else sum(steps)
  lines.append(f"next ({phase}): {len(pending)} run(s)"
               + (f", {known:,} steps" if known is not None else "")
               + (" (later batches depend on these runs' choices)" if phase == "selection"
                  else " (the last batch)"))
  lines += [f"  {t['what']}" for t in pending]
  return "\n".join(lines)


# ------------------------------------------------------------------------------ the protocol
class Study:
  """The protocol of one part. `run(tasks)` makes sure the tasks' records exist (training
  them, or refusing); `records` maps a config key to its record."""

  def __init__(self, protocol: dict, part: str, run, records: dict):
    self.protocol, self.part = protocol, part
    self.spec = protocol["parts"][part]
    if not self.spec.get("status", "").startswith("run"):
      raise ProtocolError(f"part {part!r} is not run under this protocol: "
                          f"{self.spec.get('status')}")
    self.sha = part_sha256(protocol, part)
    self._runner, self.records = run, records
    self.run = self._train
    self.chosen: dict[str, dict] = {}
    self.log: list[str] = []
    self._stale: list[str] | None = None

  # -- tasks --
  def fields(self, schedule: str, lr_mult: float, remedy: str | None, seed: int,
             epochs_factor: float = 1.0, epochs: int | None = None) -> dict:
    """A run's config fields. `remedy`: a candidate's name, or two joined by JOIN. A part
    with horizons runs `epochs` epochs (default: its selection_epochs) and sets each field
    under "fractions" to that fraction of them."""
    spec = self.spec
    f = {**copy.deepcopy(spec["fields"]), **spec["schedules"][schedule], "seed": seed}
    f["learning_rate"] = (spec["fields"]["learning_rate"]
                          * spec.get("lr_base", {}).get(schedule, 1.0) * lr_mult)
    fractions = dict(spec.get("fractions", {}))
    for name in (remedy.split(JOIN) if remedy else ()):
      r = copy.deepcopy(spec["remedies"][schedule][name])
      fractions.update(r.pop("fractions", {}))
      if "staleness" in r and f.get("staleness", "none") != "none":
        r["staleness"] = f"{f['staleness']}+{r['staleness']}"  # two methods, combined
      f.update(r)
    if "horizons" in spec:
      f["num_epochs"] = int(epochs if epochs is not None else spec["selection_epochs"])
      f.update({k: v * f["num_epochs"] for k, v in fractions.items()})
    elif epochs_factor != 1.0:
      epochs = int(round(f["num_epochs"] * epochs_factor))
      f.update(num_epochs=epochs)
    return f

  def task(self, split: str, schedule, lr_mult, remedy, seed, epochs_factor=1.0,
           epochs=None) -> dict:
    fields = self.fields(schedule, lr_mult, remedy, seed, epochs_factor, epochs)
    if split == "test":
      fields.update(self.spec.get("test_fields", {}))
    what = (f"{split} {schedule} lr x{lr_mult:g} {remedy or 'plain'} seed {seed}"
            + (f" x{epochs_factor:g} epochs" if epochs_factor != 1.0 else "")
            + (f" {epochs} epochs" if epochs is not None else ""))
    return {"key": config_key({"split": split, "fields": fields,
                               "held_out": self.spec["held_out"]}),
            "split": split, "what": what, "fields": fields, "config": self.spec["config"],
            "held_out": self.spec["held_out"], "protocol_sha256": self.sha}

  def record(self, task: dict) -> dict:
    r = self.records[task["key"]]
    if r.get("protocol_sha256") != self.sha:
      raise ProtocolError(f"the record of {task['what']} was made under another version of "
                          f"part {self.part!r} (protocol sha256 {r.get('protocol_sha256')!r},"
                          f" now {self.sha}); rerun the part")
    if task["fields"].get("staleness") == "auto":
      if "auto_resolved" not in r:
        raise ProtocolError(f"the record of {task['what']} ran staleness=auto and does not "
                            "say what auto set: rerun it")
    return r

  def stale_auto(self) -> list[str]:
    """The part's records of staleness=auto runs that trained other fields than the same
    task would train now (made under another auto table than the library's now)."""
    if self._stale is None:
      self._stale = [
          r.get("what", r["key"]) for r in self.records.values()
          if r.get("protocol_sha256") == self.sha and r["fields"].get("staleness") == "auto"
          and trained_fields(r["fields"], r) != trains_now(
              {"config": self.spec["config"], "fields": r["fields"]})]
    return self._stale

  def _train(self, tasks: list[dict]) -> None:
    """`run(tasks)`; a runner that trains refuses a batch that would add a run of a
    staleness=auto candidate (schedule, lr, remedy) with records made under another auto
    table than the library's now: one name would cover two tables' runs (and a test of auto
    would not test the auto that was selected). Other batches run. A report reads each record
    as what it ran."""
    trains = not isinstance(self._runner, (ReadOnly, Planner))
    if trains and self.stale_auto():
      stale = {_candidate(w): w for w in self.stale_auto()}
      mixing = [t["what"] for t in tasks if t["key"] not in self.records
                and t["fields"].get("staleness") == "auto" and _candidate(t["what"]) in stale]
      if mixing:
        raise ProtocolError(
            f"{len(mixing)} run(s) to add, e.g. {mixing[0]}, are of a staleness=auto "
            f"candidate with records made under another auto table than "
            f"fdg_jax/optim/auto.py's now (e.g. {stale[_candidate(mixing[0])]}): adding "
            "them would mix two tables under one name; delete those records to rerun them")
    self._runner(tasks)

  def held_out(self, schedule, lr_mult, remedy=None) -> dict:
    return self.task("held_out", schedule, lr_mult, remedy, self.spec["selection_seed"])

  # -- scores --
  @property
  def by_loss(self) -> bool:
    return self.spec.get("score", "accuracy") == "loss"

  def score(self, r: dict) -> float:
    """Higher is better: the held-out accuracy, or minus the held-out loss."""
    value = r["test_loss"] if self.by_loss else r["test_accuracy"]
    if r["diverged"] or value is None or math.isnan(value):
      return -math.inf
    return -value if self.by_loss else value

  def standard_error(self, r: dict) -> float:
    if self.by_loss:  # over the held-out sequences (trainer's test_loss_se); 0 if diverged
      return 0.0 if r["diverged"] else float(r.get("test_loss_se") or 0.0)
    n = _held_out_size(self.spec)
    p = r["test_accuracy"] if not r["diverged"] else 0.5
    return math.sqrt(max(p * (1 - p), 1e-12) / n)

  # -- the choices (held-out records only) --
  def choose_lr(self, schedule: str) -> float:
    grid = sorted(self.spec["lr_grid"])
    self.run([self.held_out(schedule, m) for m in grid])
    for _ in range(self.spec["edge_steps"]):
      best = max(grid, key=lambda m: self.score(self.record(self.held_out(schedule, m))))
      if best == grid[-1]:
        grid.append(best * self.spec["edge_factor"])
      elif best == grid[0]:
        grid.insert(0, best / self.spec["edge_factor"])
      else:
        break
      self.run([self.held_out(schedule, m) for m in grid])
    scores = {m: self.score(self.record(self.held_out(schedule, m))) for m in grid}
    best = max(grid, key=lambda m: (scores[m], m == 1.0))
    base = self.record(self.held_out(schedule, 1.0))
    if best != 1.0 and scores[best] - scores[1.0] <= self.standard_error(base):
      self.log.append(f"{schedule}: lr x{best:g} beat x1 by {scores[best] - scores[1.0]:.4f}, "
                      f"not more than the standard error {self.standard_error(base):.4f}: x1")
      best = 1.0
    return best

  def choose_remedy(self, schedule: str, lr_mult: float) -> str | None:
    remedies = list(self.spec["remedies"].get(schedule, {}))
    if not remedies:
      return None
    self.run([self.held_out(schedule, lr_mult, r) for r in [None, *remedies]])
    plain = self.record(self.held_out(schedule, lr_mult))
    scored = [(self.score(self.record(self.held_out(schedule, lr_mult, r))), -i, r)
              for i, r in enumerate(remedies)]
    score, _, best = max(scored)
    margin, se = score - self.score(plain), self.standard_error(plain)
    if margin <= se:
      self.log.append(f"{schedule}: best remedy {best} beat plain by {margin:.4f}, not more "
                      f"than the standard error {se:.4f}: plain")
      return None
    if not self.spec.get("combine"):
      return best
    # Round 2: the winner with each other candidate that also beat the plain run.
    winners = [r for sc, _, r in scored if r != best and sc - self.score(plain) > se]
    pairs = [f"{best}{JOIN}{r}" for r in winners if self.compatible(schedule, best, r)]
    if not pairs:
      return best
    self.run([self.held_out(schedule, lr_mult, p) for p in pairs])
    top = self.record(self.held_out(schedule, lr_mult, best))
    score2, _, pair = max((self.score(self.record(self.held_out(schedule, lr_mult, p))), -i, p)
                          for i, p in enumerate(pairs))
    margin2, se2 = score2 - self.score(top), self.standard_error(top)
    if margin2 > se2:
      return pair
    self.log.append(f"{schedule}: best pair {pair} beat {best} by {margin2:.4f}, not more "
                    f"than the standard error {se2:.4f}: {best}")
    return best

  def compatible(self, schedule: str, a: str, b: str) -> bool:
    """Whether candidates a and b can run together: no field set by both, but two
    staleness methods, which combine unless one is auto."""
    ra, rb = (self.spec["remedies"][schedule][n] for n in (a, b))
    if "auto" in (ra.get("staleness"), rb.get("staleness")):
      # auto decides from the rest of the config (it declines under beta != 1, say): it
      # joins only a candidate that sets nothing but fractions of the run (a warm-up)
      other = rb if ra.get("staleness") == "auto" else ra
      return set(other) <= {"fractions"}
    keys = lambda r: set(r) - {"fractions"} | {f"fractions.{k}" for k in r.get("fractions", {})}
    shared = keys(ra) & keys(rb)
    if shared == {"staleness"}:
      return "auto" not in (ra["staleness"], rb["staleness"])
    return not shared

  def select(self) -> dict:
    for schedule in self.spec["schedules"]:
      lr = self.choose_lr(schedule)
      self.chosen[schedule] = {"lr_mult": lr, "remedy": self.choose_remedy(schedule, lr)}
    return self.chosen

  # -- the test runs --
  def test_tasks(self) -> dict:
    if "horizons" in self.spec:
      return self.horizon_tasks()
    factor = self.spec["horizon_factor"]
    out = {}
    for schedule, c in self.chosen.items():
      seeds = self.spec["test_seeds"]
      out[schedule] = {"equal": [self.task("test", schedule, c["lr_mult"], c["remedy"], s)
                                 for s in seeds]}
      if schedule != "BP":
        out[schedule]["long"] = [self.task("test", schedule, c["lr_mult"], c["remedy"], s,
                                           factor) for s in seeds]
    return out

  def horizon_tasks(self) -> dict:
    """{schedule: {"equal@h": tasks, "long@h": tasks (delayed), "auto@H": tasks}}: each
    chosen setting at each horizon of h epochs and, delayed, at horizon_factor x h; and
    staleness=auto at the longest horizon where auto is not the chosen remedy."""
    spec, out = self.spec, {}
    seeds, factor = spec["test_seeds"], spec["horizon_factor"]
    longest = max(spec["horizons"])
    for schedule, c in self.chosen.items():
      cell = out[schedule] = {}
      for h in spec["horizons"]:
        cell[f"equal@{h}"] = [self.task("test", schedule, c["lr_mult"], c["remedy"], s,
                                        epochs=h) for s in seeds]
        if schedule != "BP":
          cell[f"long@{h}"] = [self.task("test", schedule, c["lr_mult"], c["remedy"], s,
                                         epochs=int(round(factor * h))) for s in seeds]
      if (schedule != "BP" and "auto" in spec["remedies"].get(schedule, {})
          and c["remedy"] != "auto"):
        cell[f"auto@{longest}"] = [self.task("test", schedule, c["lr_mult"], "auto", s,
                                             epochs=longest) for s in seeds]
    return out

  def test(self) -> dict:
    tasks = self.test_tasks()
    self.run([t for cell in tasks.values() for ts in cell.values() for t in ts])
    return {s: {k: [self.record(t) for t in ts] for k, ts in cell.items()}
            for s, cell in tasks.items()}


def _held_out_size(spec: dict) -> int:
  sizes = {"fashion_mnist": 60000, "digits": 1437}
  n = sizes[spec["fields"]["dataset"]]
  return int(round(spec["held_out"]["fraction"] * n))


# ------------------------------------------------------------------------------ the metrics
def mean_curve(records: list[dict], steps_per_epoch: int) -> list[tuple[float, float]]:
  """(step, accuracy) of the mean over runs, at the evaluations all of them reached."""
  curves = [r["curve"] for r in records if not r["diverged"]]
  if not curves or len(curves) < len(records):
    return []
  n = min(len(c) for c in curves)
  return [(curves[0][i]["epoch"] * steps_per_epoch,
           statistics.fmean(c[i]["test_accuracy"] for c in curves)) for i in range(n)]


def steps_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
  """The first step at which `curve` (linear between points, from (0, -inf)) reaches
  `target`; None if it never does."""
  prev = None
  for step, value in curve:
    if value >= target:
      if prev is None or prev[1] >= target:
        return step
      s0, v0 = prev
      return s0 + (target - v0) / (value - v0) * (step - s0)
    prev = (step, value)
  return None


def predicted_speedup(spec: dict, schedule: str) -> float | None:
  """The speed-up model's synchronous-tick throughput speed-up for the schedule's K, with
  per-stage time proportional to the stage's parameters (module docstring)."""
  sched = spec["schedules"][schedule]
  if sched["algorithm"] == "bp":
    return 1.0
  from fdg_jax.bench.speedup import predict
  params = stage_parameters(spec, sched["num_stages"])
  times = [{"forward_s": p, "backward_s": 2 * p, "tick_s": 3 * p} for p in params]
  return predict(times, [0.0] * (len(params) - 1), microbatches=())[sched["algorithm"]][
      "speedup"]


def stage_parameters(spec: dict, num_stages: int) -> list[int]:
  import jax
  import numpy as np
  from fdg_jax import models, partition
  f = spec["fields"]
  kwargs = dict(f.get("model_kwargs", {}))
  if "widths" in kwargs:
    kwargs["widths"] = tuple(kwargs["widths"])
  shape = {"fashion_mnist": (28, 28, 1), "digits": (8, 8, 1)}[f["dataset"]]
  model = models.create(f["model"], num_classes=10, input_shape=shape, **kwargs)
  x = np.zeros((1, *shape), np.float32)
  stages = partition.split(model, num_stages, f.get("split", "uniform"), example_input=x)
  import fdg_jax
  params, _ = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x)
  return [sum(int(np.size(a)) for a in jax.tree.leaves(p)) for p in params]


# ------------------------------------------------------------------------------ horizons
def text_steps_per_epoch(spec: dict) -> int:
  """Steps of an epoch of the part's training bytes: windows of seq_len, whole batches."""
  f = spec["fields"]
  return ((f["text_max_bytes"] - 1) // f["seq_len"]) // f["batch_size"]


def loss_curve(records: list[dict]) -> list[tuple[float, float]]:
  """(step, mean test loss over the runs) at the evaluations every run made; [] if one
  diverged."""
  if any(r["diverged"] for r in records):
    return []
  steps = [{p["step"]: p["test_loss"] for p in r["curve"] if "step" in p} for r in records]
  common = sorted(set.intersection(*map(set, steps))) if steps else []
  return [(s, statistics.fmean(c[s] for c in steps)) for s in common]


def steps_to_fall_to(curve: list[tuple[float, float]], target: float) -> float | None:
  """The first step at which a loss `curve` (linear between points) falls to `target`."""
  return steps_to_reach([(s, -v) for s, v in curve], -target)


def stage_flops(spec: dict, num_stages: int) -> list[float]:
  """Forward FLOPs of each stage of the part's model (XLA's cost analysis, one batch)."""
  import ml_collections
  import numpy as np
  from fdg_jax import config_check, partition
  config = load_config(str(ROOT / spec["config"]))
  for key, value in spec["fields"].items():
    config[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
  model = config_check.create_model(config)
  f = spec["fields"]
  x = np.zeros((f["batch_size"], f["seq_len"]), np.int32)
  bounds = partition.boundaries(model, num_stages, f.get("split", "uniform"),
                                example_input=x[:1])
  costs = partition.block_costs(model, x, "flops", backward=False)
  return [float(sum(costs[a:b])) for a, b in partition.stage_ranges(bounds, model.num_blocks)]


def predicted_speedup_flops(spec: dict, schedule: str) -> float:
  sched = spec["schedules"][schedule]
  if sched["algorithm"] == "bp":
    return 1.0
  from fdg_jax.bench.speedup import predict
  flops = stage_flops(spec, sched["num_stages"])
  times = [{"forward_s": c, "backward_s": 2 * c, "tick_s": 3 * c} for c in flops]
  return predict(times, [0.0] * (len(flops) - 1), microbatches=())[sched["algorithm"]][
      "speedup"]


def _ppl(records: list[dict]) -> tuple[float, float, int]:
  """(mean, std of the test perplexities, runs that did not diverge)."""
  ppl = [math.exp(r["test_loss"]) for r in records if not r["diverged"]]
  if not ppl:
    return math.nan, math.nan, 0
  return statistics.fmean(ppl), (statistics.stdev(ppl) if len(ppl) > 1 else 0.0), len(ppl)


def summarise_horizons(study: Study, tests: dict) -> dict:
  """Per horizon: BP's final test loss and each schedule's equal-step perplexity gap, step
  overhead and predicted speed-ups; and the staleness=auto runs (the protocol's rules)."""
  spec = study.spec
  spe = text_steps_per_epoch(spec)
  speedups = {s: predicted_speedup_flops(spec, s) for s in spec["schedules"]}
  out = {"steps_per_epoch": spe, "horizons": {}, "auto": {}}
  for h in spec["horizons"]:
    bp_runs = tests["BP"][f"equal@{h}"]
    bp_loss = statistics.fmean(r["test_loss"] for r in bp_runs)
    bp_ppl = _ppl(bp_runs)[0]
    rows = {}
    for schedule, cell in tests.items():
      mean, std, runs = _ppl(cell[f"equal@{h}"])
      row = {**study.chosen[schedule], "ppl": mean, "ppl_std": std, "runs": runs,
             "seeds": len(cell[f"equal@{h}"]), "steps": h * spe,
             "auto_set": cell[f"equal@{h}"][0].get("auto_resolved")}
      if schedule != "BP":
        long = loss_curve(cell[f"long@{h}"])
        reach = steps_to_fall_to(long, bp_loss)
        lowest = min(long, key=lambda p: p[1]) if long else None
        row.update(gap=mean / bp_ppl - 1, long_steps=int(round(spec["horizon_factor"] * h)) * spe,
                   long_lowest=None if lowest is None else (lowest[0], math.exp(lowest[1])),
                   step_overhead=None if reach is None else reach / (h * spe),
                   predicted_speedup=speedups[schedule])
        row["time_to_quality_speedup"] = (None if reach is None else
                                          speedups[schedule] / row["step_overhead"])
      rows[schedule] = row
    out["horizons"][str(h)] = {"bp_loss": bp_loss, "bp_ppl": bp_ppl, "bp_steps": h * spe,
                               "rows": rows}
  longest = str(max(spec["horizons"]))
  for schedule, cell in tests.items():
    for key, runs in cell.items():
      if key.startswith("auto@"):
        mean, std, n = _ppl(runs)
        out["auto"][schedule] = {"ppl": mean, "ppl_std": std, "runs": n, "seeds": len(runs),
                                 "lr_mult": study.chosen[schedule]["lr_mult"],
                                 "gap": mean / out["horizons"][longest]["bp_ppl"] - 1,
                                 "steps": int(key[5:]) * spe,
                                 "auto_set": runs[0].get("auto_resolved"),
                                 "stale": runs[0].get("what") in study.stale_auto()}
  return out


def _auto_note(resolved: dict | None) -> str:
  """' (auto: what it set)' for a row whose runs ran staleness=auto, else ''."""
  if not resolved:
    return ""
  from fdg_jax.optim import auto
  return f" (auto: {auto.describe(resolved)})"


def _overhead_cell(row: dict, word: str, closest: tuple | None, digits: int) -> str:
  """A table's step-overhead cell: '1.39×', or 'not reached in N steps (WORD V, step S)'
  with the longer run's closest point to BP's quality."""
  if row["step_overhead"] is not None:
    return f"{row['step_overhead']:.2f}×"
  return f"not reached in {row['long_steps']} steps" + (
      "" if closest is None else f" ({word} {closest[1]:.{digits}f}, step {closest[0]})")


def markdown_horizons(part: str, summary: dict, log: list[str]) -> str:
  lines = [f"<!-- time_to_quality {part}: written by `python benchmarks/time_to_quality.py "
           f"--part {part} --report --markdown` -->",
           "| steps | schedule | chosen (held-out) | test perplexity (mean ± std) | "
           "equal-step gap | step overhead to BP's test loss | predicted speed-up | "
           "predicted time-to-quality speed-up |", "|---|---|---|---|---|---|---|---|"]
  fmt = lambda r: f"{r['ppl']:.3f} ± {r['ppl_std']:.3f}" + (
      f" ({r['seeds'] - r['runs']} diverged)" if r["runs"] < r["seeds"] else "")
  for h, block in summary["horizons"].items():
    for schedule, r in block["rows"].items():
      chosen = f"lr ×{r['lr_mult']:g}" + (f", {r['remedy']}" if r["remedy"] else "")
      chosen += _auto_note(r.get("auto_set"))
      if schedule == "BP":
        lines.append(f"| {r['steps']} | BP | {chosen} | {fmt(r)} | – | 1 | 1 | 1 |")
        continue
      over = _overhead_cell(r, "lowest", r.get("long_lowest"), 3)
      ttq = ("–" if r["time_to_quality_speedup"] is None
             else f"{r['time_to_quality_speedup']:.2f}×")
      lines.append(f"| {r['steps']} | {schedule} | {chosen} | {fmt(r)} | "
                   f"{100 * r['gap']:+.1f}% | {over} | {r['predicted_speedup']:.2f}× | {ttq} |")
  for schedule, r in summary["auto"].items():
    label = "`staleness=auto` as it was" if r.get("stale") else "`staleness=auto`"
    lines.append(f"| {r['steps']} | {schedule}, {label} | lr ×{r['lr_mult']:g}, auto"
                 f"{_auto_note(r.get('auto_set'))} | {fmt(r)} | {100 * r['gap']:+.1f}% "
                 "| – | – | – |")
  if any(r.get("long_lowest") and r["step_overhead"] is None
         for block in summary["horizons"].values() for r in block["rows"].values()):
    lines += ["", "Not reached: the mean test loss over the seeds of the run trained longer "
              "never fell to BP's; in brackets its lowest, as a perplexity, and the step."]
  if log:
    lines += ["", "Ties resolved to the simpler setting (held-out split):", ""]
    lines += [f"- {entry}" for entry in log]
  return "\n".join(lines)


def plot_horizons(summary: dict, tests: dict, path: str, title: str) -> None:
  """Two panels of the same curves: the whole run on a log scale, and from the first horizon
  on at a linear scale near BP's quality, where the horizons' gaps are read."""
  import textwrap
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  horizons = list(summary["horizons"])
  longest = horizons[-1]
  curves = {}
  for schedule, cell in tests.items():
    curve = loss_curve(cell[f"equal@{longest}" if schedule == "BP" else f"long@{longest}"])
    if curve:
      curves[schedule] = [(s, math.exp(v)) for s, v in curve]
  first = summary["horizons"][horizons[0]]
  fig, axes = plt.subplots(1, 2, figsize=(10.0, 4.2))
  for ax, zoom in zip(axes, (False, True)):
    for schedule, curve in curves.items():
      ax.plot([s for s, _ in curve], [p for _, p in curve], label=schedule,
              lw=2 if schedule == "BP" else 1.2)
    for h in horizons:
      b = summary["horizons"][h]
      ax.plot([b["bp_steps"]], [b["bp_ppl"]], "k.", ms=8)
      ax.axhline(b["bp_ppl"], color="0.6", ls=":", lw=0.8)
    ax.set_xlabel("step")
    if zoom:
      low = min(p for curve in curves.values() for _, p in curve)
      ax.set_xlim(first["bp_steps"], None)
      ax.set_ylim(0.98 * low, 1.25 * first["bp_ppl"])
      ax.set_title("from the first horizon on, near BP's quality", fontsize=9)
    else:
      ax.set_yscale("log")
      ax.set_ylabel("test perplexity, mean over the test seeds")
      ax.set_title("the whole run", fontsize=9)
      ax.legend(fontsize=8)
  fig.suptitle(textwrap.fill(title, 110), fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def summarise(study: Study, tests: dict) -> dict:
  spec = study.spec
  n_train = {"fashion_mnist": 60000, "digits": 1797 - 360}[spec["fields"]["dataset"]]
  steps_per_epoch = n_train // spec["fields"]["batch_size"]
  bp = tests["BP"]["equal"]
  bp_accs = [r["test_accuracy"] for r in bp if not r["diverged"]]
  bp_final = statistics.fmean(bp_accs)
  bp_steps = spec["fields"]["num_epochs"] * steps_per_epoch
  rows = {}
  for schedule, cell in tests.items():
    accs = [r["test_accuracy"] for r in cell["equal"] if not r["diverged"]]
    row = {**study.chosen[schedule], "runs": len(accs), "seeds": len(cell["equal"]),
           "mean": 100 * statistics.fmean(accs) if accs else math.nan,
           "std": 100 * statistics.stdev(accs) if len(accs) > 1 else 0.0,
           "steps": bp_steps}
    if schedule != "BP":
      row["gap"] = row["mean"] - 100 * bp_final
      long = mean_curve(cell["long"], steps_per_epoch)
      reach = steps_to_reach(long, bp_final)
      best = max(long, key=lambda p: p[1]) if long else None
      row["long_highest"] = None if best is None else (int(round(best[0])), 100 * best[1])
      row["long_steps"] = int(round(spec["horizon_factor"] * spec["fields"]["num_epochs"])) \
          * steps_per_epoch
      row["step_overhead"] = None if reach is None else reach / bp_steps
      row["predicted_speedup"] = predicted_speedup(spec, schedule)
      row["time_to_quality_speedup"] = (None if reach is None
                                        else row["predicted_speedup"] / row["step_overhead"])
    rows[schedule] = row
  return {"bp_final_accuracy": 100 * bp_final, "bp_steps": bp_steps,
          "steps_per_epoch": steps_per_epoch, "rows": rows}


def markdown(part: str, summary: dict, log: list[str]) -> str:
  rows = summary["rows"]
  lines = [f"<!-- time_to_quality {part}: written by `python benchmarks/time_to_quality.py "
           f"--part {part} --report --markdown` -->",
           f"| schedule | chosen (held-out) | test accuracy % (mean ± std) | equal-step gap "
           f"| step overhead to BP's {summary['bp_final_accuracy']:.2f} | predicted speed-up "
           f"| predicted time-to-quality speed-up |", "|---|---|---|---|---|---|---|"]
  for schedule, r in rows.items():
    chosen = f"lr ×{r['lr_mult']:g}" + (f", {r['remedy']}" if r["remedy"] else "")
    acc = f"{r['mean']:.2f} ± {r['std']:.2f}" + (
        f" ({r['seeds'] - r['runs']} diverged)" if r["runs"] < r["seeds"] else "")
    if schedule == "BP":
      lines.append(f"| BP | {chosen} | {acc} | – | 1 ({r['steps']} steps) | 1 | 1 |")
      continue
    over = _overhead_cell(r, "highest", r.get("long_highest"), 2)
    ttq = ("–" if r["time_to_quality_speedup"] is None
           else f"{r['time_to_quality_speedup']:.2f}×")
    lines.append(f"| {schedule} | {chosen} | {acc} | {r['gap']:+.2f} | {over} | "
                 f"{r['predicted_speedup']:.2f}× | {ttq} |")
  if any(r.get("long_highest") and r["step_overhead"] is None for r in rows.values()):
    lines += ["", "Not reached: the mean test accuracy over the seeds of the run trained "
              "longer never rose to BP's; in brackets its highest and the step."]
  if log:
    lines += ["", "Ties resolved to the simpler setting (held-out split):", ""]
    lines += [f"- {entry}" for entry in log]
  return "\n".join(lines)


def derive_auto(study: Study):
  """The part's held-out choices as `fdg_jax.optim.auto` states them: a `Row` whose cells
  map each delayed schedule's (algorithm, K) to a `Choice` of its chosen learning rate over
  BP's chosen one and the remedy it chose, as config fields (a `staleness=auto` candidate
  read as what it set when it ran: the record's `auto_resolved`) and fractions of the run.
  Needs `study.select()` first."""
  from fdg_jax import plans
  from fdg_jax.optim import auto
  spec = study.spec
  bp = [s for s, v in spec["schedules"].items() if not plans.spec(v["algorithm"]).delayed]
  if len(bp) != 1:
    raise ProtocolError(f"part {study.part!r} has no single BP schedule to scale rates from")
  bp_lr = study.fields(bp[0], study.chosen[bp[0]]["lr_mult"], None, 0)["learning_rate"]
  cells = {}
  for schedule, c in study.chosen.items():
    if schedule in bp:
      continue
    names = c["remedy"].split(JOIN) if c["remedy"] else []
    fractions = {k: v for n in names
                 for k, v in spec["remedies"][schedule][n].get("fractions", {}).items()}
    plain = study.held_out(schedule, c["lr_mult"])["fields"]
    task = study.held_out(schedule, c["lr_mult"], c["remedy"])
    chosen = trained_fields(task["fields"], study.record(task))
    fields = {k: v for k, v in chosen.items()
              if k not in fractions and k != "learning_rate" and plain.get(k) != v}
    lr_mult = study.fields(schedule, c["lr_mult"], None, 0)["learning_rate"] / bp_lr
    where = spec["schedules"][schedule]
    cells[(where["algorithm"], where["num_stages"])] = auto.Choice(lr_mult, fields, fractions)
  f = spec["fields"]
  return auto.Row(part=study.part, what="", optimizer=f["optimizer"],
                  momentum=f.get("momentum") if f["optimizer"] == "sgd" else None, cells=cells)


def auto_mismatch(study: Study) -> str | None:
  """Where `fdg_jax.optim.auto.STUDY` differs from the part's held-out choices (one line),
  or None where they agree cell by cell (the learning-rate multiples to 1e-12)."""
  from fdg_jax.optim import auto
  derived = derive_auto(study)
  rows = [r for r in auto.STUDY if r.part == study.part]
  if not rows:
    return f"auto.STUDY has no row for part {study.part}"
  row = rows[0]
  if (row.optimizer, row.momentum) != (derived.optimizer, derived.momentum):
    return (f"auto.STUDY's {study.part} row is {row.optimizer} momentum {row.momentum}; the "
            f"part ran {derived.optimizer} momentum {derived.momentum}")
  if set(row.cells) != set(derived.cells):
    return (f"auto.STUDY's {study.part} cells are {sorted(row.cells)}; the part's "
            f"{sorted(derived.cells)}")
  for cell, want in derived.cells.items():
    got = row.cells[cell]
    if ((dict(got.fields), dict(got.fractions)) != (dict(want.fields), dict(want.fractions))
        or not math.isclose(got.lr_mult, want.lr_mult, rel_tol=1e-12)):
      return f"auto.STUDY at {cell} is {got}; the part's held-out choice is {want}"
  return None


def _auto_header(study: Study) -> str:
  return (f"<!-- time_to_quality {study.part} auto: written by `python "
          f"benchmarks/time_to_quality.py --part {study.part} --report --auto_markdown` -->")


def auto_markdown(study: Study, summary: dict) -> str:
  """The docs' table of what `staleness=auto` sets from this part, each row with the test
  result of that setting (the chosen setting's test runs); refused where `auto.STUDY` is not
  the part's held-out choice."""
  from fdg_jax.optim import auto
  wrong = auto_mismatch(study)
  if wrong:
    raise ProtocolError(f"{wrong}: make fdg_jax/optim/auto.py's STUDY the part's choices")
  derived = derive_auto(study)
  horizons = "horizons" in study.spec
  if horizons:
    block = summary["horizons"][str(max(study.spec["horizons"]))]
    rows, metric = block["rows"], f"test perplexity at {block['bp_steps']} steps (mean ± std)"
  else:
    rows, metric = summary["rows"], "test accuracy % (mean ± std)"
  bp = next(s for s, v in study.spec["schedules"].items() if (v["algorithm"], v["num_stages"])
            not in derived.cells)
  bp_lr = study.fields(bp, study.chosen[bp]["lr_mult"], None, 0)["learning_rate"]
  lines = [_auto_header(study),
           f"| schedule | `staleness=auto` sets (lr relative to BP's chosen {bp_lr:g}) | the "
           f"part's held-out choice | {metric} | vs BP |", "|---|---|---|---|---|"]
  for schedule, where in study.spec["schedules"].items():
    cell = (where["algorithm"], where["num_stages"])
    if cell not in derived.cells or schedule not in rows:
      continue
    c, r = derived.cells[cell], rows[schedule]
    held = study.record(study.held_out(schedule, r["lr_mult"], r["remedy"]))
    lr = study.fields(schedule, r["lr_mult"], None, 0)["learning_rate"]
    chosen = f"lr {lr:g}, {r['remedy'] or 'no remedy'}" + _auto_note(
        held.get("auto_resolved"))
    if horizons:
      value, gap = f"{r['ppl']:.3f} ± {r['ppl_std']:.3f}", f"{100 * r['gap']:+.1f}%"
    else:
      value, gap = f"{r['mean']:.2f} ± {r['std']:.2f}", f"{r['gap']:+.2f}"
    lines.append(f"| {schedule} | {auto.sets(c)} | {chosen} | {value} | {gap} |")
  return "\n".join(lines)


def plot(summary: dict, tests: dict, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  spe = summary["steps_per_epoch"]
  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  for schedule, cell in tests.items():
    curve = mean_curve(cell.get("long", cell["equal"]), spe)
    if curve:
      ax.plot([s for s, _ in curve], [100 * a for _, a in curve], label=schedule,
              lw=2 if schedule == "BP" else 1.2)
  ax.axhline(summary["bp_final_accuracy"], color="0.5", ls=":", lw=1)
  ax.axvline(summary["bp_steps"], color="0.5", ls=":", lw=1)
  ax.set_xlabel("step")
  ax.set_ylabel("test accuracy %, mean over the test seeds")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  lo = min(a for cell in tests.values() for _, a in mean_curve(cell["equal"], spe)) * 100
  ax.set_ylim(max(lo - 1, 0), summary["bp_final_accuracy"] + 2)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------ targets
def selection_targets(spec: dict, summary: dict) -> list[dict]:
  """The part's targets (protocol "targets") with the measured value, bound and met: "gap
  CELL" (accuracy points, or the perplexity's relative gap) and "step_overhead CELL" (a
  step overhead of None, never reached within the longer run, misses any bound), at the
  longest horizon where the part has several."""
  if "horizons" in summary:
    rows = summary["horizons"][str(max(int(h) for h in summary["horizons"]))]["rows"]
  else:
    rows = summary["rows"]
  out = []
  for t in spec.get("targets", []):
    kind, _, cell = t["quantity"].partition(" ")
    value = rows[cell].get(kind)
    if value is None:
      met, note = False, "not reached within the longer run"
    else:
      met = value >= t["bound"] if t["sense"] == ">=" else value <= t["bound"]
      note = None
    out.append({"target": t["target"], "value": value, "bound": t["bound"], "met": met,
                **({"note": note} if note else {})})
  return out


# ------------------------------------------------------------------------------ main
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", required=True)
  parser.add_argument("--protocol", default=str(PROTOCOL))
  parser.add_argument("--report", action="store_true", help="from the part's records only")
  parser.add_argument("--markdown", action="store_true", help="print the docs' table only")
  parser.add_argument("--auto_markdown", action="store_true",
                      help="print the docs' table of what staleness=auto sets from this part "
                           "(refused where it is not the part's held-out choice) only")
  parser.add_argument("--status", action="store_true",
                      help="where the part stands: choices so far and the next runs (trains "
                           "nothing, reads no test score)")
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--plot", default="", help="a PNG of the test curves against steps")
  parser.add_argument("--workdir", default=str(ROOT / "runs" / "time_to_quality"))
  parser.add_argument("--out", default="")
  parser.add_argument("--targets_json", action="store_true",
                      help="with --report: the part's pre-registered targets as a JSON list")
  args = parser.parse_args(argv)
  protocol = load_protocol(args.protocol)
  if args.part not in protocol["parts"]:
    parser.error(f"unknown part {args.part!r}; the protocol has {list(protocol['parts'])}")
  if "cells" in protocol["parts"][args.part]:  # a fixed recipe, no selection
    import ttq_recipe
    return ttq_recipe.main(protocol, args.part, args)
  out = pathlib.Path(args.out or ROOT / "docs" / "results" / f"time_to_quality_{args.part}.json")
  started = time.time()
  if args.status:
    records = json.loads(out.read_text())["records"] if out.exists() else {}
    try:
      print(status(Study(protocol, args.part, Planner(records), records)))
    except ProtocolError as e:
      raise SystemExit(f"error: {e}")
    return 0
  if args.report:
    if not out.exists():
      raise SystemExit(f"error: {out} does not exist; run the part without --report first")
    runner = ReadOnly(json.loads(out.read_text())["records"])
  else:
    runner = Runner(out, pathlib.Path(args.workdir) / args.part, args.jobs)
  try:
    study = Study(protocol, args.part, runner, runner.records)
    study.select()
    tests = study.test()
  except ProtocolError as e:
    raise SystemExit(f"error: {e}")
  finally:
    if isinstance(runner, Runner):
      runner.close()
  horizons = "horizons" in study.spec
  summary = (summarise_horizons if horizons else summarise)(study, tests)
  if args.targets_json:
    print(json.dumps(selection_targets(study.spec, summary), indent=1))
    return 0
  text = (markdown_horizons if horizons else markdown)(args.part, summary, study.log)
  if args.auto_markdown:
    print(auto_markdown(study, summary))
    return 0
  print(text)
  if not args.markdown:
    for t in selection_targets(study.spec, summary):
      shown = t.get("note") or f"{t['value']:.4g}"
      print(f"target: {t['target']}: {shown} (bound {t['bound']:g}): "
            f"{'met' if t['met'] else 'missed'}")
  if args.plot and horizons:
    plot_horizons(summary, tests, args.plot, f"{args.part}: test perplexity against steps "
                  f"(BP's longest run, the delayed schedules' {study.spec['horizon_factor']:g}× "
                  "longer one; dots: BP's final at each horizon)")
  elif args.plot:
    plot(summary, tests, args.plot, f"{args.part}: test accuracy against steps (delayed "
         f"schedules at {study.spec['horizon_factor']:g}× BP's epochs)")
  if not args.report:
    data = json.loads(out.read_text())
    data.update(part=args.part, protocol_sha256=study.sha, chosen=study.chosen,
                ties=study.log, summary=summary,
                last_run_s=time.time() - started)
    out.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=True))
    if not args.markdown:
      print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
