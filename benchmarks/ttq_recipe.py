"""The time-to-quality study's fixed-recipe part (fashion_resnet): one recipe, cells x seeds.

    python benchmarks/time_to_quality.py --part fashion_resnet            # pilot, then cells
    python benchmarks/time_to_quality.py --part fashion_resnet --status
    python benchmarks/time_to_quality.py --part fashion_resnet --report [--markdown]
    python benchmarks/time_to_quality.py --part fashion_resnet --report --targets_json

No grid is searched: every cell trains the part's recipe (the papers' regime) with its own
schedule and K. The horizon is the one thing chosen, on a pilot: BP on the held-out split
with the rate held constant, whose plateau rule (in the protocol) gives the run's epochs.

Every run is a process of its own held to its cores: a one-core run is one process pinned
to one core (the fused engine); a two-core run is two processes under `python -m
fdg_jax.launch --pin`, stage k in process k. The scheduler runs two one-core runs side by
side or one two-core run alone, in the protocol's order. A run stopped by SIGTERM or Ctrl-C
saves a checkpoint and goes on from it next time (bitwise); a run that fails other than by
diverging stops the study with its last line and adds no record.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity import ROOT, load_config, run_one, validation_split, with_fields  # noqa: E402

HELD_OUT = {"fraction": 0.1, "seed": 0}


class RunFailed(Exception):
  """A run that ended in an error other than a divergence: the study stops, no record."""


# ------------------------------------------------------------------------------ the tasks
def spec_sha(protocol: dict, part: str, *, pilot: bool = False) -> str:
  """The version of the part's test runs (its whole spec and the shared rules), or of its
  pilot (what the pilot trains: the recipe without the horizon, the pilot's rules)."""
  spec = protocol["parts"][part]
  if pilot:
    fields = {k: v for k, v in spec["fields"].items() if k != "num_epochs"}
    body = {"pilot": spec["pilot"], "fields": fields, "config": spec["config"]}
  else:
    body = {"name": protocol["name"], "rules": protocol["rules"], "part": spec}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def config_key(payload: dict) -> str:
  return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def milestones(spec: dict, epochs: int) -> list[float]:
  return [round(f * epochs, 4) for f in spec["milestone_fractions"]]


def _task(protocol: dict, part: str, split: str, what: str, fields: dict, cell: dict) -> dict:
  spec = protocol["parts"][part]
  payload = {"split": split, "fields": fields, "held_out": HELD_OUT if split == "held_out"
             else None}
  return {"key": config_key(payload), "split": split, "what": what, "fields": fields,
          "config": spec["config"], "held_out": HELD_OUT, "processes": cell["processes"],
          "cores": cell["cores"],
          "protocol_sha256": spec_sha(protocol, part, pilot=split == "held_out")}


def pilot_task(protocol: dict, part: str) -> dict:
  spec = protocol["parts"][part]
  fields = {**copy.deepcopy(spec["fields"]), **_cell_fields(spec["cells"]["BP"]), "seed": 0,
            "lr_schedule": "constant", "num_epochs": int(spec["pilot"]["epochs"])}
  fields.pop("lr_milestones", None)
  return _task(protocol, part, "held_out", "pilot BP seed 0", fields, spec["cells"]["BP"])


def _cell_fields(cell: dict) -> dict:
  """The config fields a cell sets: its schedule, K, beta and (where it fixes one) split."""
  out = {"algorithm": cell["algorithm"], "num_stages": cell["num_stages"],
         "beta": float(cell.get("beta", 1.0))}
  if "split" in cell:
    out["split"] = cell["split"]
  return out


def cell_tasks(protocol: dict, part: str) -> dict[str, list[dict]]:
  """{cell: [its test task per seed]} at the part's horizon (fields.num_epochs)."""
  spec = protocol["parts"][part]
  epochs = int(spec["fields"]["num_epochs"])
  out = {}
  for name, cell in spec["cells"].items():
    out[name] = []
    for seed in cell["seeds"]:
      fields = {**copy.deepcopy(spec["fields"]), **_cell_fields(cell), "seed": seed,
                "lr_milestones": milestones(spec, epochs)}
      out[name].append(_task(protocol, part, "test", f"test {name} seed {seed}", fields, cell))
  return out


def run_order(protocol: dict, part: str) -> list[dict]:
  """The test tasks in the protocol's order: BP seeds 0 and 1, FDG K=2, the K=4 cells, the
  rest of BP, then the optional cells."""
  tasks = cell_tasks(protocol, part)
  spec = protocol["parts"][part]
  required = [c for c in spec["cells"] if not spec["cells"][c].get("optional")]
  optional = [c for c in spec["cells"] if spec["cells"][c].get("optional")]
  first = tasks["BP"][:2]
  middle = [t for c in required if c != "BP" for t in tasks[c]]
  return first + middle + tasks["BP"][2:] + [t for c in optional for t in tasks[c]]


# ------------------------------------------------------------------------------ one run
def code_commit() -> str:
  """The checkout's commit, with '+dirty' when tracked files differ from it."""
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown"
  return (head or "unknown") + ("+dirty" if dirty else "")


def _config(task: dict):
  import ml_collections
  config = load_config(str(ROOT / task["config"]))
  fields = copy.deepcopy(task["fields"])
  config.model_kwargs = ml_collections.ConfigDict(fields.pop("model_kwargs", {}))
  if "lr_milestones" in fields:
    fields["lr_milestones"] = tuple(fields["lr_milestones"])
  return config, fields


def run_config(task: dict):
  """The exact config a task's run trains (as `run_one` builds it)."""
  base, fields = _config(task)
  config = with_fields(base, **fields)
  config.progress_bar = False
  return config


def worker(task_path: str) -> int:
  """One process of a run: trains it (resuming its checkpoint) and, as process 0, writes
  its record next to the task file."""
  task = json.loads(pathlib.Path(task_path).read_text())
  from fdg_jax import runtime, trainer
  trainer.setup_cpu_devices(int(task["fields"].get("num_cpu_devices", 1)))
  runtime.initialize()
  import jax
  base, fields = _config(task)
  held = (validation_split(task["held_out"]["fraction"], task["held_out"]["seed"])
          if task["split"] == "held_out" else contextlib.nullcontext())
  cpu0, wall0 = time.process_time(), time.time()
  with held:
    record = run_one(base, task["workroot"], task["key"], resume=True, clear=False, **fields)
  record["cpu_per_wall"] = (time.process_time() - cpu0) / max(time.time() - wall0, 1e-9)
  record["affinity"] = sorted(os.sched_getaffinity(0))
  if jax.process_index() == 0:
    out = pathlib.Path(task_path).with_suffix(".record.json")
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, allow_nan=True))
    tmp.replace(out)
  return 0


class CoreRunner:
  """Runs tasks as pinned processes, two one-core runs or one two-core run at a time, in
  order; keeps every record in the part's JSON as it lands."""

  def __init__(self, out: pathlib.Path, workroot: pathlib.Path, cores=None):
    self.out, self.workroot = out, workroot
    self.cores = list(cores if cores is not None else sorted(os.sched_getaffinity(0))[:2])
    self.records = json.loads(out.read_text())["records"] if out.exists() else {}
    self.stopping = None
    self.commits: dict = {}  # key -> the checkout's commit when its (last) process started

  def __call__(self, tasks: list[dict]) -> None:
    queue = [t for t in tasks if t["key"] not in self.records]
    queue = list({t["key"]: t for t in queue}.values())
    if not queue:
      return
    big = next((t for t in queue if t["cores"] > len(self.cores)), None)
    if big is not None:  # it would wait for cores forever
      raise RunFailed(f"{big['what']} needs {big['cores']} cores and this process may use "
                      f"{len(self.cores)} ({self.cores}); run the study where {big['cores']} "
                      "cores are free to it (check taskset or the job's CPU allocation)")
    self.workroot.mkdir(parents=True, exist_ok=True)
    running: dict = {}  # Popen -> (task, cores)
    free = list(self.cores)
    previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
    signalled: set = set()
    try:
      while running or (queue and self.stopping is None):  # stopping: wait for the runs only
        while queue and self.stopping is None and queue[0]["cores"] <= len(free):
          task = queue.pop(0)
          use, free = free[:task["cores"]], free[task["cores"]:]
          running[self._start(task, use)] = (task, use)
        if self.stopping is not None:
          for p in running:
            if p.pid not in signalled:  # once: a second signal would cut a save short
              _signal_group(p, signal.SIGTERM)
              signalled.add(p.pid)
        for p in [p for p in running if p.poll() is not None]:
          task, use = running.pop(p)
          free += use
          self._finish(task, p.returncode, running)
        time.sleep(0.5)
      if self.stopping is not None:
        raise KeyboardInterrupt(f"stopped by signal {self.stopping}: the runs saved "
                                "checkpoints; run the same command to go on")
    finally:
      for s, h in previous.items():
        signal.signal(s, h)

  def _stop(self, signum, frame):
    del frame
    self.stopping = signum

  def _start(self, task: dict, cores: list[int]):
    path = self.workroot / f"{task['key']}.task.json"
    path.write_text(json.dumps({**task, "workroot": str(self.workroot)}))
    path.with_suffix(".record.json").unlink(missing_ok=True)
    workdir = self.workroot / task["key"]
    import parity
    if parity.resumable_step(str(workdir), run_config(task)) is None:
      shutil.rmtree(workdir, ignore_errors=True)  # another config's leftovers, or nothing
    me = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", str(path)]
    if task["processes"] > 1:
      cmd = [sys.executable, "-m", "fdg_jax.launch", "--num-processes",
             str(task["processes"]), "--cpu-devices", "1", "--pin", "--grace", "300", "--", *me]
    else:
      cmd = me
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    log = open(self.workroot / f"{task['key']}.log", "a")
    log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {task['what']} on cores {cores}\n")
    log.flush()
    self.commits[task["key"]] = code_commit()  # the code the run imports, not later edits
    print(f"  start {task['what']} on core(s) {cores}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, set(cores)))

  def _finish(self, task: dict, code: int, running: dict) -> None:
    path = self.workroot / f"{task['key']}.task.json"
    out = path.with_suffix(".record.json")
    if code == 0 and out.exists():
      record = json.loads(out.read_text())
      self.records[task["key"]] = {**record, "key": task["key"], "split": task["split"],
                                   "what": task["what"], "fields": task["fields"],
                                   "processes": task["processes"], "cores": task["cores"],
                                   "protocol_sha256": task["protocol_sha256"],
                                   "code_commit": self.commits.get(task["key"])}
      self.save()
      print(f"  done  {task['what']}: test accuracy {record['test_accuracy']:.4f}, "
            f"{record['wall_time']:.0f} s" + (" DIVERGED" if record["diverged"] else ""),
            flush=True)
      return
    if self.stopping is not None:
      return  # stopped at a checkpoint, to go on next time
    for p in running:
      _signal_group(p, signal.SIGTERM)
    for p in running:
      p.wait()
    log = self.workroot / f"{task['key']}.log"
    raise RunFailed(f"{task['what']} failed (exit {code}): {_last_line(log)}; its log: {log}; "
                    "no record was kept")

  def save(self) -> None:
    data = json.loads(self.out.read_text()) if self.out.exists() else {}
    data["records"] = self.records
    tmp = self.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=True))
    tmp.replace(self.out)


def _signal_group(p, sig) -> None:
  with contextlib.suppress(ProcessLookupError):
    os.killpg(p.pid, sig)


def _last_line(path: pathlib.Path) -> str:
  try:
    lines = [l.strip() for l in path.read_text().splitlines() if l.strip()]
  except OSError:
    return "(no log)"
  errors = [l for l in lines if l.split("] ", 1)[-1].startswith(("error", "config error",
                                                                   "Traceback"))]
  tail = [l for l in lines if not l.startswith(("---", "  File"))]
  return (errors[-1] if errors else tail[-1] if tail else "(empty log)")[:400]


# ------------------------------------------------------------------------------ the pilot
def plateau_epoch(accuracies: list[float], window: int = 6, smooth: int = 3,
                  points: float = 0.25) -> int:
  """The protocol's plateau rule on a(1..N) (fractions): the first e >= smooth with e +
  window <= N whose smoothed accuracy no later smoothed value within `window` epochs
  exceeds by `points` points or more; N if there is none."""
  n = len(accuracies)
  m = {e: statistics.fmean(accuracies[e - smooth:e]) for e in range(smooth, n + 1)}
  for e in range(smooth, n - window + 1):
    if max(m[f] for f in range(e + 1, e + window + 1)) - m[e] < points / 100:
      return e
  return n


def horizon(spec: dict, plateau: int) -> int:
  """H = 2 P rounded up to a multiple of 4, within [12, 32] (the protocol's horizon rule)."""
  h = 4 * math.ceil(2 * plateau / 4)
  return min(max(h, 12), 32)


def pilot_curve(record: dict) -> list[float]:
  return [row["test_accuracy"] for row in record["curve"] if float(row["epoch"]).is_integer()
          and row["epoch"] >= 1]


# ------------------------------------------------------------------------------ the report
def _mean_curve(records: list[dict], axis: str) -> list[tuple[float, float]]:
  curves = [r["curve"] for r in records]
  n = min(len(c) for c in curves)
  key = (lambda row: row["step"]) if axis == "steps" else (lambda row: row["wall_time"])
  return [(statistics.fmean(key(c[i]) for c in curves),
           statistics.fmean(c[i]["test_accuracy"] for c in curves)) for i in range(n)]


def crossing(curve: list[tuple[float, float]], target: float) -> float | None:
  """The first x at which the curve (linear between points) reaches `target`; None if it
  never does (the study's own `steps_to_reach`, on any axis)."""
  from time_to_quality import steps_to_reach
  return steps_to_reach(curve, target)


def summarise(protocol: dict, part: str, records: dict) -> dict:
  """Per cell: seeds, final accuracies, gap, step overhead, seconds to BP's quality."""
  spec = protocol["parts"][part]
  sha = spec_sha(protocol, part)
  tasks = cell_tasks(protocol, part)
  rows = {}
  for name, ts in tasks.items():
    have = [records[t["key"]] for t in ts if t["key"] in records
            and records[t["key"]].get("protocol_sha256") == sha]
    row = {"cell": name, "seeds": [r["seed"] for r in have], "of": len(ts),
           "cores": spec["cells"][name]["cores"], "records": have}
    ok = [r for r in have if not r["diverged"]]
    row["diverged"] = len(have) - len(ok)
    row["complete"] = len(have) == len(ts)
    if ok:
      accs = [100 * r["test_accuracy"] for r in ok]
      row.update(final=statistics.fmean(accs), std=statistics.stdev(accs) if len(accs) > 1
                 else 0.0, each=accs, wall=statistics.fmean(r["wall_time"] for r in ok))
    rows[name] = row
  bp = rows["BP"]
  steps = bp["records"][0]["curve"][-1]["step"] if bp["records"] else None  # BP's whole run
  for row in rows.values():
    if "final" not in row or "final" not in bp or row["diverged"] or not bp["complete"]:
      continue
    row["gap"] = row["final"] - bp["final"]
    target = statistics.fmean(r["test_accuracy"] for r in bp["records"])
    at = crossing(_mean_curve(row["records"], "steps"), target)
    row["step_overhead"] = None if at is None else at / steps
    if row["cores"] == 2 or row["cell"] == "BP":
      row["seconds_to_bp"] = crossing(_mean_curve(row["records"], "seconds"), target)
  for row in rows.values():
    if bp.get("seconds_to_bp") and row.get("seconds_to_bp") is not None and row["cell"] != "BP":
      row["seconds_ratio"] = row["seconds_to_bp"] / bp["seconds_to_bp"]
  return {"rows": rows, "targets": targets(spec, rows), "steps": steps}


def targets(spec: dict, rows: dict) -> list[dict]:
  """Each pre-registered target with its measured value, its bound and met (None: not
  measured yet)."""
  out = []
  for t in spec.get("targets", []):
    kind, _, cells = t["quantity"].partition(" ")
    if kind == "gap" and cells.startswith("best of "):
      names = [c.strip() for c in cells[len("best of "):].split(",")]
      values = [rows[c].get("gap") for c in names if rows[c]["complete"]]
      value = max(values) if values and None not in values else None
    elif kind == "gap":
      value = rows[cells].get("gap") if rows[cells]["complete"] else None
    else:  # "seconds ratio CELL"
      cell = cells.split(" ", 1)[1]
      value = rows[cell].get("seconds_ratio") if rows[cell]["complete"] else None
    met = None if value is None else (value >= t["bound"] if t["sense"] == ">="
                                      else value <= t["bound"])
    out.append({"target": t["target"], "value": value, "bound": t["bound"], "met": met})
  return out


MARKER = ("<!-- time_to_quality fashion_resnet: written by `python benchmarks/time_to_quality.py "
          "--part fashion_resnet --report` -->")


def markdown(summary: dict) -> str:
  lines = [MARKER, "| cell | seeds | test accuracy % (mean ± std) | each seed | vs BP (points) | "
           "steps to BP's final | seconds to BP's final |", "|---|---|---|---|---|---|---|"]
  for row in summary["rows"].values():
    seeds = f"{len(row['seeds'])} of {row['of']}" + (f", {row['diverged']} diverged"
                                                     if row["diverged"] else "")
    if "final" not in row:
      lines.append(f"| {row['cell']} | {seeds} | not run | | | | |")
      continue
    each = ", ".join(f"{a:.2f}" for a in row["each"])
    gap = "" if row["cell"] == "BP" or "gap" not in row else f"{row['gap']:+.2f}"
    over = row.get("step_overhead")
    over = ("not reached" if over is None else f"{over:.2f}×") if "gap" in row else ""
    secs = row.get("seconds_to_bp")
    if row["cores"] == 2 or row["cell"] == "BP":
      secs = "not reached" if secs is None and "gap" in row else (
          f"{secs:,.0f} s" if secs is not None else "")
      if row.get("seconds_ratio") is not None:
        secs += f" ({row['seconds_ratio']:.2f}× BP's)"
    else:
      secs = "(one core: steps only)"
    lines.append(f"| {row['cell']} | {seeds} | {row['final']:.2f} ± {row['std']:.2f} | {each} "
                 f"| {gap} | {over} | {secs} |")
  lines.append("")
  for t in summary["targets"]:
    state = "not measured yet" if t["met"] is None else ("met" if t["met"] else "missed")
    value = "" if t["value"] is None else f": {t['value']:+.2f}" if "points" in t["target"] \
        or "within" in t["target"] else f": {t['value']:.2f}"
    lines.append(f"- {t['target']} (bound {t['bound']:g}){value} — **{state}**")
  return "\n".join(lines)


def status(protocol: dict, part: str, records: dict) -> str:
  spec = protocol["parts"][part]
  pilot = pilot_task(protocol, part)
  lines = [f"part {part} (status {spec['status']!r})"]
  rec = records.get(pilot["key"])
  if rec is None or rec.get("protocol_sha256") != pilot["protocol_sha256"]:
    lines.append(f"next (pilot): {pilot['what']}, {spec['pilot']['epochs']} epochs on the "
                 "held-out split")
    return "\n".join(lines)
  acc = pilot_curve(rec)
  p = plateau_epoch(acc)
  lines.append(f"pilot: {len(acc)} epochs, held-out accuracy " +
               ", ".join(f"{100 * a:.2f}" for a in acc))
  lines.append(f"  plateau epoch P = {p}; horizon H = {horizon(spec, p)} epochs "
               f"(milestones {milestones(spec, horizon(spec, p))})")
  if spec["status"] != "run":
    lines.append("next: write H into the part (fields.num_epochs, status 'run') and commit it "
                 "before any test run")
    return "\n".join(lines)
  order = run_order(protocol, part)
  done = [t for t in order if t["key"] in records]
  todo = [t for t in order if t["key"] not in records]
  lines.append(f"test runs: {len(done)} of {len(order)} recorded")
  lines += [f"  pending: {t['what']} ({t['cores']} core(s))" for t in todo]
  if not todo:
    lines.append("complete: --report prints it")
  return "\n".join(lines)


def plot(summary: dict, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for row in summary["rows"].values():
    ok = [r for r in row["records"] if not r["diverged"]]
    if not ok:
      continue
    for ax, axis in zip(axes, ("steps", "seconds")):
      if axis == "seconds" and row["cores"] != 2 and row["cell"] != "BP":
        continue
      xs, ys = zip(*_mean_curve(ok, axis))
      ax.plot(xs, [100 * y for y in ys], label=f"{row['cell']} ({len(ok)} seeds)")
  bp = summary["rows"]["BP"]
  for ax, xl in zip(axes, ("steps", "seconds (BP on one core; K=2 on two, a stage each)")):
    if "final" in bp:
      ax.axhline(bp["final"], color="grey", lw=0.8, ls=":")
      ax.set_ylim(bp["final"] - 4, bp["final"] + 1.5)
    ax.set_xlabel(xl)
    ax.set_ylabel("test accuracy %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(protocol: dict, part: str, args) -> int:
  spec = protocol["parts"][part]
  out = pathlib.Path(args.out or ROOT / "docs" / "results" / f"time_to_quality_{part}.json")
  records = json.loads(out.read_text())["records"] if out.exists() else {}
  if args.status:
    print(status(protocol, part, records))
    return 0
  if args.report:
    if spec["status"] != "run":
      raise SystemExit(f"error: part {part} has no horizon yet (status {spec['status']!r}): "
                       "run its pilot, then write H into the protocol")
    summary = summarise(protocol, part, records)
    if args.targets_json:
      print(json.dumps(summary["targets"], indent=1))
      return 0
    print(markdown(summary))
    if args.plot:
      plot(summary, args.plot, f"{part}: ResNet-20 (width 8) on Fashion-MNIST, the papers' "
           f"recipe, {spec['fields']['num_epochs']} epochs; mean over seeds")
    return 0
  runner = CoreRunner(out, pathlib.Path(args.workdir) / part)
  try:
    pilot = pilot_task(protocol, part)
    runner([pilot])
    if spec["status"] != "run":
      print(status(protocol, part, runner.records))
      return 0
    runner(run_order(protocol, part))
  except RunFailed as e:
    raise SystemExit(f"error: {e}")
  except KeyboardInterrupt as e:
    print(str(e), file=sys.stderr)
    return 130
  print(status(protocol, part, runner.records))
  return 0


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--worker":
    sys.exit(worker(sys.argv[2]))
  raise SystemExit("usage: python benchmarks/time_to_quality.py --part fashion_resnet ...")
