"""`python -m fdg_jax.bench memory`: bytes held by each stage's delay buffer
(`schedule.stash_bytes`) of every registered delayed schedule under stash and recompute, next
to the parameter bytes and backprop's activation bytes. Exact on any machine: nothing is
timed.
"""

from __future__ import annotations

from fdg_jax.bench.common import (POLICIES, PRESETS, build_model, build_stages,
                                  make_schedule, progress, tick_plans, tree_bytes,
                                  with_backward)


def bench_memory(args) -> list[dict]:
  """Delay-buffer bytes per stage against parameter and activation bytes, per preset."""
  import jax
  from fdg_jax import partition
  rows = []
  for preset in args.presets:
    name, kwargs, shape, batch_size = PRESETS[preset]
    model = build_model(name, kwargs, shape)
    x = model.example_input(batch_size)
    # Backprop's activation memory: the vjp residuals of the unsplit model for one batch.
    whole = partition.stages_from_boundaries(model, [])[0]
    bp_activation = partition.residual_bytes(whole, x)
    infos = partition.block_info(model, x)
    for K in [k for k in args.stages if k > 1]:
      bounds, stages, params, states = build_stages(model, K, args.split, batch_size)
      param_bytes = [tree_bytes(p) for p in params]
      # What crosses each boundary (one activation message; the cotangent is the same size).
      boundary = [int(infos[b - 1].output.size * infos[b - 1].output.dtype.itemsize)
                  for b in bounds]
      batch = (jax.numpy.zeros(x.shape, x.dtype),
               jax.numpy.zeros((batch_size,), jax.numpy.int32))
      for algorithm in with_backward(tick_plans()):
        for policy in POLICIES:
          schedule = make_schedule(algorithm, stages, backward=policy, devices=None)
          state = schedule.init(params, states, example_batch=batch)
          stash = schedule.stash_bytes(state)
          del state
          total = sum(stash)
          # With the rings' heads (the default off CPU): one more slot where D >= 2. A
          # stage's bytes are D slots and D int32 batch indices.
          heads = total if schedule.ring_heads else total + sum(
              (b - 4 * D) // D for b, D in zip(stash, schedule.ring_sizes) if D > 1)
          rows.append({
              "preset": preset, "model": model.name, "batch_size": batch_size,
              "input_shape": list(model.input_shape), "num_stages": K, "boundaries": bounds,
              "algorithm": algorithm, "backward": policy, "ring_sizes": schedule.ring_sizes,
              "ring_heads": schedule.ring_heads, "stash_bytes": stash,
              "stash_bytes_total": total, "stash_bytes_total_with_heads": heads,
              "param_bytes": param_bytes, "param_bytes_total": sum(param_bytes),
              "bp_activation_bytes": bp_activation, "boundary_activation_bytes": boundary,
              "stash_over_params": total / max(sum(param_bytes), 1),
              "stash_over_bp_activations": total / max(bp_activation, 1),
          })
          progress(f"memory {preset} {algorithm} K={K} {policy}: {_mib(total)}")
  return rows


def _mib(n: float) -> str:
  return f"{n / 2**20:.2f} MiB"


def memory_table(rows) -> str:
  lines = ["| model (batch) | K | schedule | backward | stash per stage (MiB) | total MiB | "
           "× params | × BP activations | total MiB with ring heads |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    per = ", ".join(f"{b / 2**20:.2f}" for b in r["stash_bytes"])
    lines.append(f"| {r['model']} ({r['batch_size']}) | {r['num_stages']} | "
                 f"{r['algorithm'].upper()} | {r['backward']} | {per} | "
                 f"{r['stash_bytes_total'] / 2**20:.2f} | {r['stash_over_params']:.1f} | "
                 f"{r['stash_over_bp_activations']:.2f} | "
                 f"{r['stash_bytes_total_with_heads'] / 2**20:.2f} |")
  seen = {}
  for r in rows:
    seen.setdefault((r["model"], r["batch_size"]), r)
  notes = [f"{m} (batch {b}): parameters {_mib(r['param_bytes_total'])}, backprop "
           f"activations (vjp residuals of one batch) {_mib(r['bp_activation_bytes'])}"
           for (m, b), r in seen.items()]
  return "\n".join(lines + [""] + notes)
