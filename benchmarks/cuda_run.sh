#!/usr/bin/env bash
# The whole GPU check in one call, under 5 minutes, no network.
#
#   On a lent GPU (device tool, repository root; results come back from $OUT):
#       bash benchmarks/cuda_run.sh
#   Rehearsal on a CPU machine (tiny, exercises every step and the CUDA matrix's listing):
#       DEVICE=cpu OUT=/tmp/cuda_run bash benchmarks/cuda_run.sh
#
# Steps, each under its own timeout so one stuck step cannot eat the lease:
#   1. environment: nvidia-smi, python and torch versions            -> $OUT/env.txt
#   2. correctness: slim vs stock over the core matrix, fp32 and bf16 -> $OUT/correctness.{txt,json}
#   3. benchmark: bf16+fp16, L 512-4096, E=768/H=12 and E=1024/H=16,
#      inference and training, need_weights both (the CUDA matrix)  -> $OUT/cuda_bench.{txt,json,png}
# The benchmark writes its JSON after every case, so a timeout still leaves the cases it finished.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/slim_mha_cuda_run}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
# The device machine runs its own python3 and torch; the project is used from this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse --short HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null || true
    "$PYTHON" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$DEVICE" = cuda ]; then
    correctness_args=(--device cuda --dtype fp32,bf16 --sweep 300)
    bench_args=(--device cuda --time-budget-s 170)
    correctness_limit=90
    bench_limit=200
else
    correctness_args=(--device cpu --dtype fp32,bf16 --sweep 4 --limit 24)
    bench_args=(--device cpu --dtype bf16 --shape 2x32x64x4 --mode inference,train --repeats 2 --warmup 1)
    correctness_limit=60
    bench_limit=120
    "$PYTHON" -m slim_mha.bench run --device cpu --matrix cuda --dry-run >"$OUT/cuda_matrix.txt" || status=1
    head -n 1 "$OUT/cuda_matrix.txt"
fi

echo "== correctness (${correctness_args[*]})"
timeout "$correctness_limit" "$PYTHON" tests/device_matrix.py "${correctness_args[@]}" \
    --json "$OUT/correctness.json" >"$OUT/correctness.txt" 2>&1 || status=1
head -n 40 "$OUT/correctness.txt"

echo "== benchmark (${bench_args[*]})"
timeout "$bench_limit" "$PYTHON" -m slim_mha.bench run "${bench_args[@]}" \
    --json "$OUT/cuda_bench.json" --plot "$OUT/cuda_speedup.png" >"$OUT/cuda_bench.txt" 2>"$OUT/cuda_bench.log" || status=1
cat "$OUT/cuda_bench.txt"
tail -n 5 "$OUT/cuda_bench.log"

echo "== done, status $status; files in $OUT:"
ls -l "$OUT"
exit "$status"
