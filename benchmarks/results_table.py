"""The README's results table, generated from the committed records.

    python benchmarks/results_table.py           # print it
    python benchmarks/results_table.py --write   # and the generated blocks of the docs, in place

One row per (workload, schedule) of the time-to-quality parts that have records, in the
form of the Flax examples' tables: workload, schedule, steps, wall time and what it ran on,
the test metric, the gap to BP, and the command that reruns (or reports) it. The two facts
a reader needs first come before the table: whether any delayed schedule has matched BP's
final quality here, and the speed-up measured on parallel hardware (`bench cores`).
Nothing is typed by hand: `tests/test_docs.py` checks that the README holds this output.
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "docs" / "results"
MARKER = "<!-- results table: written by `python benchmarks/results_table.py` -->"


def _load(name: str) -> dict | None:
  path = RESULTS / name
  return json.loads(path.read_text()) if path.exists() else None


def _command(part: str) -> str:
  return f"`python benchmarks/time_to_quality.py --part {part} --report`"


def resnet_rows() -> tuple[list[list[str]], list[str]]:
  """The fashion_resnet part's rows, and its delayed cells that matched BP."""
  import time_to_quality
  import ttq_recipe
  protocol = time_to_quality.load_protocol()
  data = _load("time_to_quality_fashion_resnet.json")
  summary = ttq_recipe.summarise(protocol, "fashion_resnet", (data or {}).get("records", {}))
  spec = protocol["parts"]["fashion_resnet"]
  workload = (f"Fashion-MNIST, ResNet-20 (width 8), SGD 0.9, lr cut ×0.1 three times, "
              f"{spec['fields']['num_epochs']} epochs")
  rows, matched = [], []
  for name, row in summary["rows"].items():
    if spec["cells"][name].get("optional") and not row["seeds"]:
      continue
    if "final" not in row or not row["complete"]:
      have = f"{len(row['seeds'])} of {row['of']} seeds recorded" if row["seeds"] else ""
      rows.append([workload, name, "", "", f"not run yet{'; ' + have if have else ''}", "",
                   _command("fashion_resnet")])
      continue
    if row["cores"] == 2 or name == "BP":
      cores = f"{row['cores']} pinned CPU core{'s' if row['cores'] > 1 else ''}"
      wall = f"{row['wall'] / 60:.0f} min on {cores}"
    else:
      wall = "— (steps only: every stage on one core)"
    gap = "" if name == "BP" or "gap" not in row else f"{row['gap']:+.2f} points"
    if name != "BP" and row.get("gap", -1) >= 0:
      matched.append(f"{name} on ResNet-20")
    rows.append([workload, name, f"{summary['steps']:,}", wall,
                 f"accuracy {row['final']:.2f} ± {row['std']:.2f} %", gap,
                 _command("fashion_resnet")])
  return rows, matched


def mlp_rows() -> tuple[list[list[str]], list[str]]:
  data = _load("time_to_quality_fashion_mlp.json")
  if data is None:
    return [], []
  s = data["summary"]
  workload = "Fashion-MNIST, 8-layer MLP, SGD 0.9, cosine, 8 epochs"
  rows, matched = [], []
  for name, row in s["rows"].items():
    gap = "" if name == "BP" else f"{row['gap']:+.2f} points"
    if name != "BP" and row["gap"] >= 0:
      matched.append(f"{name} on the MLP")
    rows.append([workload, name, f"{row['steps']:,}", "— (steps only: stages shared the cores)",
                 f"accuracy {row['mean']:.2f} ± {row['std']:.2f} %", gap,
                 _command("fashion_mlp")])
  return rows, matched


def gpt_rows() -> tuple[list[list[str]], list[str]]:
  data = _load("time_to_quality_gpt_long.json")
  if data is None:
    return [], []
  horizons = data["summary"]["horizons"]
  h = horizons[str(max(int(k) for k in horizons))]
  workload = "stdlib source bytes, GPT (width 64, 6 blocks), rotated Adam"
  rows, matched = [], []
  for name, row in h["rows"].items():
    gap = "" if name == "BP" else f"{100 * row['gap']:+.1f} % perplexity"
    if name != "BP" and row["gap"] <= 0:
      matched.append(f"{name} on the GPT")
    rows.append([workload, name, f"{row['steps']:,}", "— (steps only: stages shared the cores)",
                 f"perplexity {row['ppl']:.3f} ± {row['ppl_std']:.3f}", gap,
                 _command("gpt_long")])
  return rows, matched


def speedup_sentence() -> str:
  data = _load("bench_cores_cpu.json")
  if data is None:
    return "No speed-up has been measured on parallel hardware yet."
  rows = {r["name"]: r for r in data["rows"]}
  fdg = next((r for r in data["rows"] if r["algorithm"] == "fdg" and r["num_stages"] == 2),
             None)
  if fdg is None:
    return "No speed-up has been measured on parallel hardware yet."
  both = next((r for r in data["rows"] if r["algorithm"] == "bp" and r["num_stages"] == 1
               and r["replicas"] == 1 and r["cores"] == 2), None)
  vs_both = (f", {fdg['samples_per_s'] / both['samples_per_s']:.2f}× BP on both cores as one "
             "device" if both else "")
  del rows
  return (f"Measured speed-up: FDG K = 2 with a stage per CPU core trains "
          f"{fdg['speedup']:.2f}× the samples per second of BP on one core{vs_both} "
          f"(`python -m fdg_jax.bench cores`, ResNet-20 at width 8, batch "
          f"{data['args']['batch_size']}; [docs/benchmarks.md](docs/benchmarks.md)). "
          "No accelerator has been measured yet.")


def render() -> str:
  parts = [resnet_rows(), mlp_rows(), gpt_rows()]
  matched = [m for _, ms in parts for m in ms]
  if matched:
    quality = ("Delayed schedules that ended at or above BP's final test quality here: "
               + ", ".join(matched) + ".")
  else:
    quality = ("No delayed schedule has yet ended at BP's final test quality in these "
               "studies (gaps below; each study's protocol was committed before its runs).")
  head = ["workload", "schedule", "steps", "wall time (on what)", "test metric (mean ± std)",
          "vs BP", "reproduce"]
  lines = [MARKER, quality + " " + speedup_sentence(), "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for rows, _ in parts:
    for i, r in enumerate(rows):  # a workload and its command named once, on its first row
      r = list(r)
      if i:
        r[0] = r[-1] = ""
      lines.append("| " + " | ".join(r) + " |")
  return "\n".join(lines)


END = "<!-- end of the generated block -->"


def _report(part: str, *flags: str) -> str:
  """What `time_to_quality.py --part <part> --report <flags>` prints."""
  import subprocess
  out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_to_quality.py"),
                        "--part", part, "--report", *flags], capture_output=True, text=True,
                       check=True, cwd=ROOT)
  return out.stdout.strip()


def _replace(path: pathlib.Path, block: str) -> None:
  """Puts `block` (its first line a marker) in place of the one between that marker and END."""
  text = path.read_text()
  start = text.index(block.splitlines()[0])
  end = text.index(END, start)
  path.write_text(text[:start] + block + "\n" + text[end:])


def write() -> None:
  """Regenerates, in place, the README's table, docs/results.md's fashion_resnet table and
  docs/staleness.md's account of `staleness=auto` (its table and the runs behind each row)."""
  from fdg_jax.optim import auto
  _replace(ROOT / "README.md", render())
  _replace(ROOT / "docs" / "results.md", _report("fashion_resnet"))
  staleness = ROOT / "docs" / "staleness.md"
  _replace(staleness, auto.markdown())
  for part in ("fashion_mlp", "gpt_long"):
    _replace(staleness, _report(part, "--auto_markdown"))


if __name__ == "__main__":
  if sys.argv[1:] == ["--write"]:
    write()
  else:
    print(render())
