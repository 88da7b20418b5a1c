"""FDG K=4's fused `run` with its stages gated by masks or by chained conditionals, by size.

    python benchmarks/gates.py [--repeats 5] [--out docs/results/bench_gates_cpu.json]

`Schedule.gate` picks how the fused engine gates each stage's work on the warm-up flags:
"mask" (compute, then keep the old state where the flag is off) or "cond" (a switch over
the flag combinations, the tick's switches chained so that XLA runs the stages one after
another). This times both, interleaved, on one device for MLPs of several sizes (64 inputs,
four hidden layers, uniform split) and a small GPT (no convolution either), all trained by
SGD with momentum 0.9 (the papers' optimiser, as in `fdg_jax.bench`), and prints,
per model, the FLOPs of its largest stage's training forward (as `Schedule` counts them for
its default), the masked tick's time and the conditionals' time over the masks' (median
[min, max] of the per-repetition ratios), and which gate the default takes.
"""

from __future__ import annotations

import os
import argparse

import numpy as np

# (label, MLP width or "gpt", batch)
CONFIGS = [("MLP 4x128, batch 32 (the quick start)", 128, 32),
           ("MLP 4x256, batch 32", 256, 32),
           ("MLP 4x512, batch 128", 512, 128),
           ("MLP 4x1024, batch 32", 1024, 32),
           ("GPT width 128, depth 6, batch 16 x 128 tokens", "gpt", 16)]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--run_ticks", type=int, default=16, help="T, ticks per `run` call")
  p.add_argument("--budget_s", type=float, default=0.2,
                 help="timed seconds per repetition and gate, roughly (sets the ticks)")
  p.add_argument("--only", type=int, nargs="+", default=None,
                 help="indices of CONFIGS to run (default all)")
  p.add_argument("--out", default=None)
  return p.parse_args(argv)


def build(width, batch):
  """(stages, params, model states, batch, loss) of FDG K=4's model."""
  import jax
  import jax.numpy as jnp
  import fdg_jax
  from fdg_jax import models, partition
  from fdg_jax.bench import common as B
  if width == "gpt":
    from fdg_jax.models.transformer import lm_loss
    m = models.create("gpt", num_classes=256, seq_len=128, dim=128, depth=6, num_heads=4)
    x = jax.random.randint(jax.random.PRNGKey(0), (batch, 128), 0, 256, jnp.int32)
    stages = partition.split(m, 4, "balanced", example_input=x[:1])
    params, states = fdg_jax.init_stages(stages, jax.random.PRNGKey(0), x[:1])
    return stages, params, states, (x, jnp.roll(x, -1, axis=1)), lm_loss
  model = B.build_model("mlp", {"widths": [width] * 4}, (8, 8, 1))
  _, stages, params, states = B.build_stages(model, 4, "uniform", batch)
  return stages, params, states, B.random_batch(model, batch), B.loss_fn


def main(argv=None) -> dict:
  from fdg_jax.runtime import compile_cache
  compile_cache.enable(os.environ.get("FDG_JAX_COMPILATION_CACHE", "auto"))
  args = parse_args(argv)
  import fdg_jax
  from fdg_jax.bench import common, timing
  rows = []
  chosen = [CONFIGS[i] for i in args.only] if args.only else CONFIGS
  for label, width, batch in chosen:
    stages, params, states, data, loss = build(width, batch)
    entries = []
    for gate in (None, "mask", "cond"):
      schedule = fdg_jax.fdg(stages, loss, common.optimizer(), gate=gate,
                             metrics_fn=lambda out, y: {})
      if gate is None:  # the default's choice, from the prepared shapes
        schedule.init(params, states, example_batch=data)
        default, flops = schedule.gate, max(schedule.forward_flops())
        continue
      entries.append(timing.prepare(schedule, params, states, data, run_ticks=args.run_ticks))
    probe = timing.time_interleaved(entries, ticks=args.run_ticks, repeats=1)
    per_tick = float(np.median(probe[0]["step"]))
    ticks = max(args.run_ticks, int(args.budget_s / per_tick) // args.run_ticks
                * args.run_ticks)
    times = timing.time_interleaved(entries, ticks=ticks, repeats=args.repeats)
    mask, cond = (np.asarray(t["step"]) for t in times)
    ratio = cond / mask
    rows.append({"model": label, "forward_flops_max_stage": flops,
                 "mask_tick_s": float(np.median(mask)),
                 "cond_over_mask": [float(np.median(ratio)), float(ratio.min()),
                                    float(ratio.max())],
                 "default_gate": default, "ticks_per_repetition": ticks})
    print(f"{label}: stage forward {flops / 1e6:.2f} MFLOP, masks {1e3 * np.median(mask):.3f}"
          f" ms per tick, conditionals x{np.median(ratio):.3f} [{ratio.min():.3f}, "
          f"{ratio.max():.3f}], default {default}", flush=True)
    del entries
  print("\n| model | largest stage forward, MFLOP | masks, ms per tick | conditionals "
        "/ masks, median [min, max] | default |\n|---|---|---|---|---|")
  for r in rows:
    q = r["cond_over_mask"]
    print(f"| {r['model']} | {r['forward_flops_max_stage'] / 1e6:.2f} | "
          f"{1e3 * r['mask_tick_s']:.3f} | {q[0]:.3f} [{q[1]:.3f}, {q[2]:.3f}] | "
          f"{r['default_gate']} |")
  return common.write_figures({"args": vars(args), "device": common.device_info(),
                               "rows": rows}, args.out)


if __name__ == "__main__":
  main()
