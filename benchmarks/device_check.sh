#!/usr/bin/env bash
# The engine's figures on an accelerator, in one bounded run (each benchmark is stopped
# after LIMIT seconds; the whole script takes at most 9 x LIMIT, 9 min 18 s by default).
#
#   pip install --no-deps -e . && OUT=/tmp/device_check bash benchmarks/device_check.sh
#
# Writes each benchmark's JSON and log under $OUT and prints the tables. What it answers:
#   schedules      every plan side by side (BP, DDG, FDG, GPipe and 1F1B with M = 4) on
#                  the default MLP (4 x 1024) at K = 4: throughput, host calls per tick, peak stash, and the
#                  speed-up model's prediction for M = 4, 8, 16 and data parallelism
#   nested         do backward convolutions run slowly inside loops/switches here, as on
#                  XLA:CPU (the rule behind `Schedule.scan`)?
#   dispatch_*     host time per stage per tick of `step` and `run`: tiny MLP (every engine,
#                  the SPMD program too), ResNet-110 K=4 (with its compile time): the
#                  per-stage `step` (on one GPU, its 4 stages' calls on that GPU), the fused
#                  engine, and the SPMD program last (its compile time is not known)
#   overhead_*     one device, FDG K=4 over BP K=1 per sample: quick-start MLP, ResNet-20 in
#                  float32 and bfloat16; the quick start (through `run`) with its stages
#                  gated by masks and by chained conditionals (`Schedule.gate`; on CPU the
#                  conditionals are the default), each also with XLA:GPU's copy insertion
#                  with region analysis, side by side (on CPU its twin is the default, and
#                  lets the stash rings drop their heads: docs/notes.md 3.9)
# (Stash memory is exact on any machine: `python -m fdg_jax.bench memory` needs no accelerator.)
# The most wanted figures come first.
# The figures go to docs/notes.md, marked with the device they were measured on.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_check}
LIMIT=${LIMIT:-62}
mkdir -p "$OUT"
python -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/devices.txt"

run() {
  local name=$1
  shift
  echo "== $name: python -m fdg_jax.bench $*"
  timeout "$LIMIT" python -m fdg_jax.bench "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "   exit $?"
  grep -v "^  " "$OUT/$name.log" | tail -n 20
}

QUICKSTART=(--model mlp --model_kwargs '{"widths":[128,128,128,128]}' --input_shape 8 8 1
            --batch_size 32 --stages 4 --split uniform)
RESNET20=(--model resnet20 --batch_size 64 --stages 4 --split balanced --algorithms fdg
          --ticks 8 --repeats 3)

run schedules speedup --batch_size 128 --stages 1 4 --split uniform \
    --algorithms bp ddg fdg gpipe 1f1b --sync_microbatches 4 --microbatches 4 8 16 \
    --ticks 10 --repeats 3
run nested nested
RESNET110=(--dispatch_model resnet110 --dispatch_batch 2 --split balanced --stages 4
           --algorithms fdg --repeats 3)
# Per-stage `step` (its 150 µs target): on 4 devices, or with one GPU its 4 stages' calls on it.
run dispatch_resnet110 dispatch "${RESNET110[@]}" --dispatch_ticks 16 --engines per_stage \
    --paths step
run dispatch_resnet110_fused dispatch "${RESNET110[@]}" --dispatch_ticks 16 --run_ticks 32 \
    --engines fused
run overhead_resnet20_f32 overhead "${RESNET20[@]}" --dtype float32
run overhead_resnet20_bf16 overhead "${RESNET20[@]}" --dtype bfloat16
run dispatch_tiny dispatch --stages 4 --algorithms bp ddg fdg --repeats 3
run overhead_quickstart overhead "${QUICKSTART[@]}" --ticks 64 --repeats 5 \
    --algorithms fdg --paths run --gates mask cond \
    --compiler_options default '{"xla_gpu_copy_insertion_use_region_analysis": true}'
run dispatch_resnet110_spmd dispatch --dispatch_model resnet110 --dispatch_batch 2 \
    --split balanced --stages 4 --algorithms fdg --dispatch_ticks 64 --run_ticks 32 \
    --repeats 3 --engines spmd --paths run
