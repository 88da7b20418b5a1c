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
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from parity import ROOT  # noqa: E402
from staleness import Runner, _task  # noqa: E402

VIT = {"model": "vit", "optimizer": "adam", "learning_rate": 1e-3, "momentum": 0.0,
       "weight_decay": 0.0, "split": "balanced",
       "model_kwargs": {"input_shape": (8, 8, 1), "patch_size": 2, "dim": 64, "depth": 6,
                        "num_heads": 4}}
GPT = {"model_kwargs": {"seq_len": 128, "dim": 128, "depth": 6, "num_heads": 4}}
METHODS = (("BP K=1", {"algorithm": "bp", "num_stages": 1}),
           ("FDG K=4", {"algorithm": "fdg", "num_stages": 4}),
           ("FDG K=8", {"algorithm": "fdg", "num_stages": 8}))


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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", nargs="+", default=["vit", "lm"], choices=("vit", "lm"))
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--lm_bytes", type=int, default=1_000_000)
  parser.add_argument("--lm_epochs", type=int, default=1)
  parser.add_argument("--jobs", type=int, default=2)
  parser.add_argument("--k8_staleness", default="",
                      help="also FDG K=8 with this staleness method (lr_by_delay: lr/d_k "
                           "without ramp), e.g. lr_by_delay")
  parser.add_argument("--workdir", default=str(ROOT / "runs" / "workloads"))
  parser.add_argument("--out", default=str(ROOT / "docs" / "workloads.json"))
  args = parser.parse_args(argv)
  args.set = []
  methods = list(METHODS)
  if args.k8_staleness:
    methods.append((f"FDG K=8 + {args.k8_staleness}",
                    {"algorithm": "fdg", "num_stages": 8, "staleness": args.k8_staleness,
                     "staleness_ramp_epochs": -1.0}))
  started = time.time()
  result = {"description": "BP vs FDG on ViT/digits and GPT/stdlib text; "
                           "benchmarks/workloads.py", "seeds": args.seeds}
  for part in args.parts:
    if part == "vit":
      args.config, base = str(ROOT / "configs" / "default.py"), VIT
    else:
      args.config = str(ROOT / "configs" / "lm.py")
      base = {**GPT, "text_max_bytes": args.lm_bytes, "num_epochs": args.lm_epochs}
    runner = Runner(args)
    try:
      tasks = [_task(f"{part}_{label.replace(' ', '_').replace('=', '')}_s{seed}",
                     {**base, **fields, "seed": seed}, None, method=label)
               for seed in args.seeds for label, fields in methods]
      rows = runner.run(tasks)  # the Runner fills in config, overrides and workroot
      for r in rows:
        r["test_perplexity"] = math.exp(r["test_loss"]) if not r["diverged"] else math.nan
    finally:
      runner.close()
    keys = ["test_accuracy", "test_loss"] + (["test_perplexity"] if part == "lm" else [])
    result[part] = {"summary": summary(rows, keys, methods), "runs": rows}
    scale = {"test_accuracy": 100.0, "test_loss": 1.0, "test_perplexity": 1.0}
    print(f"\n{part}:\n" + table(result[part]["summary"], keys, scale), flush=True)
  result["total_time_s"] = time.time() - started
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1, allow_nan=True)
  print(f"wrote {args.out} in {result['total_time_s']:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
