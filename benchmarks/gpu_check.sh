#!/usr/bin/env bash
# One call on one GPU (issue 29): calibrate it, then run a default set of real training steps (GPT
# and Llama-shaped models; unfused and flash attention; recompute none, selective, full; 14 plans)
# and predict each with the profile just fitted. Everything lands in one folder: the calibration
# ledger and its overhead runs, the profile, the validation ledger, the error table.
#
#   benchmarks/gpu_check.sh [OUT]                 one CUDA GPU (about 4 minutes on an H200)
#   DEVICE=xpu BASE=smng-p2 benchmarks/gpu_check.sh [OUT]      one Intel GPU tile
#   DEVICE=cpu QUICK=1 benchmarks/gpu_check.sh OUT             the plumbing, on a CPU (tests/test_gpu_check.py)
#   LIST=1 benchmarks/gpu_check.sh                              print the models and plans, run nothing
#
# Needs only torch (with numpy and scipy) on the machine: perfsim runs from this checkout
# (PYTHONPATH), nothing is installed. Ledgers are appended to and resumed, so a run that was stopped
# goes on where it stopped; a plan already in the validation ledger is read back, not run again.
# Commit what it writes as hwprofiles/ledgers/<gpu>-<date>/ and its table in docs/calibration.md.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-gpu-check-$(date -u +%Y%m%d-%H%M%S)}
device=${DEVICE:-cuda}
base=${BASE:-dgx-h100}

perfsim() {
    PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
        'import sys; from perfsim.cli import main; sys.exit(main(sys.argv[1:]))' "$@"
}

# The models: a GPT (LayerNorm, GeLU, multi-head attention, biases) and a Llama-shaped one
# (RMSNorm, SwiGLU, grouped-query attention, rotary positions, no biases); neither is the
# calibration's model. QUICK: tiny ones, two plans each, one timed step.
if [[ -n "${QUICK:-}" ]]; then
    gpt="layers=2,hidden=128,heads=4,seq=64,vocab=512,tied_embeddings=false,dropout=false"
    llama="layers=2,hidden=128,heads=4,kv_heads=2,ffn=352,activation=swiglu,norm=rmsnorm,bias=false"
    llama+=",learned_positions=false,seq=64,vocab=512,tied_embeddings=false,dropout=false"
    gpt_plans="mbs=2,gbs=4;mbs=2,gbs=4,attention=flash,recompute=full"
    llama_plans="mbs=2,gbs=4,attention=flash;mbs=2,gbs=4,recompute=selective"
    calibrate_size=(--quick --model "$gpt")
    steps=1
else
    gpt="layers=8,hidden=2048,heads=16,seq=2048,vocab=32768,tied_embeddings=false,dropout=false"
    llama="layers=4,hidden=2048,heads=16,kv_heads=4,ffn=5632,activation=swiglu,norm=rmsnorm,bias=false"
    llama+=",learned_positions=false,seq=2048,vocab=32000,tied_embeddings=false,dropout=false"
    gpt_plans="mbs=1,gbs=8;mbs=4,gbs=8;mbs=4,gbs=8,recompute=selective;mbs=4,gbs=8,recompute=full"
    gpt_plans+=";mbs=4,gbs=8,attention=flash;mbs=2,gbs=8,attention=flash,recompute=full"
    gpt_plans+=";mbs=8,gbs=8,attention=flash,recompute=selective"
    llama_plans="mbs=2,gbs=4;mbs=2,gbs=4,attention=flash;mbs=4,gbs=8,attention=flash"
    llama_plans+=";mbs=2,gbs=8,attention=flash,recompute=full;mbs=4,gbs=4,recompute=selective"
    llama_plans+=";mbs=1,gbs=4,attention=flash,recompute=selective;mbs=8,gbs=8,attention=flash,recompute=full"
    calibrate_size=()
    steps=5
fi

if [[ -n "${LIST:-}" ]]; then
    printf '%s\t%s\n' "$gpt" "$gpt_plans" "$llama" "$llama_plans"
    exit 0
fi

start=$(date +%s)
mkdir -p "$out"
out=$(cd "$out" && pwd)
echo "== calibrate ($device, base $base) -> $out/gpu.toml"
perfsim calibrate --device "$device" --nproc 1 --system "$base" --suites gemm,memory,attention,overheads \
    "${calibrate_size[@]}" --ledger "$out/cal.jsonl" --out "$out/gpu.toml" | tee "$out/calibrate.txt"

: > "$out/errors.txt"
for which in gpt llama; do
    model=${!which}
    plans_var="${which}_plans"
    echo "== validate $which: $model" | tee -a "$out/errors.txt"
    perfsim validate --device "$device" --nproc 1 --system "$out/gpu.toml" --model "$model" \
        --plans "${!plans_var}" --steps "$steps" --speed-tolerance inf \
        --ledger "$out/validation.jsonl" | tee -a "$out/errors.txt"
done
echo "== $(($(date +%s) - start)) s in all; ledgers, profile and tables in $out" | tee -a "$out/errors.txt"
