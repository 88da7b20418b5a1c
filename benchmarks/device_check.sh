#!/usr/bin/env bash
# The engine's figures on an accelerator, in one bounded run: each benchmark is stopped at
# its own limit (seconds, below; SCALE multiplies them all), 7 min 30 s in all; EXTRA=1 adds
# the SPMD program's dispatch (its compile time is not known) and `bench cores` on the host's
# CPU cores at K = 2 and 4 (2 min 30 s more). BUNDLE=file.tgz: OUT packed
# into one file after each benchmark (what a run cut short still brings back).
#
#   pip install --no-deps -e . && OUT=/tmp/device_check bash benchmarks/device_check.sh
#   (PYTHON: the interpreter to use, default python3)
#
# (ml_collections, for configs/lm.py's GPT, must be importable; PyTorch for the torch rows.)
#
# Writes each benchmark's JSON and log under $OUT and prints the tables. What it answers:
#   schedules      every plan side by side (BP, DDG, FDG, PipeDream, GPipe and 1F1B with M = 4) on
#                  the default MLP (4 x 1024) at K = 4: throughput, host calls per tick, peak stash, and the
#                  speed-up model's prediction for M = 4, 8, 16 and data parallelism
#   gpt_torch      configs/lm.py's GPT (its batch of 32) against the same network in
#                  PyTorch on the GPU: BP and FDG K=4 (torch: the paper's one thread per
#                  stage), seconds per batch side by side (benchmarks/torch_cpu.py --device gpu)
#   nested         do backward convolutions run slowly inside loops/switches here, as on
#                  XLA:CPU (the rule behind `Schedule.scan`)?
#   dispatch_*     host time per stage per tick of `step` and `run`: tiny MLP (every engine,
#                  the SPMD program too), ResNet-110 K=4 (with its compile time): the
#                  per-stage `step` (on one GPU, its 4 stages' calls on that GPU), the fused
#                  engine, and with EXTRA=1 the SPMD program (its compile time is not known)
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
PYTHON=${PYTHON:-python3}
SCALE=${SCALE:-1}
mkdir -p "$OUT"
"$PYTHON" -c "import jax; print(jax.__version__, jax.devices())" | tee "$OUT/devices.txt"

pack() {
  if [ -n "${BUNDLE:-}" ]; then tar czf "$BUNDLE" -C "$(dirname "$OUT")" "$(basename "$OUT")"; fi
}

# run NAME LIMIT_S BENCH_ARGS...: python -m fdg_jax.bench BENCH_ARGS, its JSON and log in OUT
run() {
  local name=$1 limit=$(( $2 * SCALE ))
  shift 2
  echo "== $name (limit ${limit} s): python -m fdg_jax.bench $*"
  timeout "$limit" "$PYTHON" -m fdg_jax.bench "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "   exit $?"
  grep -v "^  " "$OUT/$name.log" | tail -n 20
  pack
}

QUICKSTART=(--model mlp --model_kwargs '{"widths":[128,128,128,128]}' --input_shape 8 8 1
            --batch_size 32 --stages 4 --split uniform)
RESNET20=(--model resnet20 --batch_size 64 --stages 4 --split balanced --algorithms fdg
          --ticks 8 --repeats 3)
RESNET110=(--dispatch_model resnet110 --dispatch_batch 2 --split balanced --stages 4
           --algorithms fdg --repeats 3)

run schedules 90 speedup --batch_size 128 --stages 1 4 --split uniform \
    --algorithms bp ddg fdg pipedream gpipe 1f1b --sync_microbatches 4 --microbatches 4 8 16 \
    --ticks 10 --repeats 3
run overhead_quickstart 45 overhead "${QUICKSTART[@]}" --ticks 64 --repeats 5 \
    --algorithms fdg --paths run --gates mask cond \
    --compiler_options default '{"xla_gpu_copy_insertion_use_region_analysis": true}'
limit=$(( 110 * SCALE ))
echo "== gpt_torch (limit ${limit} s): python benchmarks/torch_cpu.py --device gpu --models gpt"
timeout "$limit" "$PYTHON" benchmarks/torch_cpu.py --device gpu --models gpt --no_checks \
    --repeats 2 --batches 40 --ticks_per_call 8 --out "$OUT/gpt_torch.json" \
    > "$OUT/gpt_torch.log" 2>&1
echo "   exit $?"
grep -v "^repeat" "$OUT/gpt_torch.log" | tail -n 14
pack
run overhead_resnet20_f32 45 overhead "${RESNET20[@]}" --dtype float32
run overhead_resnet20_bf16 40 overhead "${RESNET20[@]}" --dtype bfloat16
# Per-stage `step` (its 150 µs target): on 4 devices, or with one GPU its 4 stages' calls on it.
run dispatch_resnet110 40 dispatch "${RESNET110[@]}" --dispatch_ticks 16 --engines per_stage \
    --paths step
run dispatch_tiny 30 dispatch --stages 4 --algorithms bp ddg fdg pipedream --repeats 3
run nested 20 nested
run dispatch_resnet110_fused 30 dispatch "${RESNET110[@]}" --dispatch_ticks 16 --run_ticks 32 \
    --engines fused
if [ "${EXTRA:-0}" = 1 ]; then
  run dispatch_resnet110_spmd 60 dispatch --dispatch_model resnet110 --dispatch_batch 2 \
      --split balanced --stages 4 --algorithms fdg --dispatch_ticks 64 --run_ticks 32 \
      --repeats 3 --engines spmd --paths run
  # The host's own cores as K pinned processes (CPU; on this 2-core machine only K = 2 fits).
  run cores_cpu 90 cores --model_kwargs '{"width": 8}' --stages 2 4 --algorithms fdg \
      --rounds 3
fi
