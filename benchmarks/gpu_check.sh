#!/usr/bin/env bash
# GPU check, for a machine with CUDA (the device machine when one is lent). Under 9 minutes on
# one GPU, each part under its own time limit:
#   1. step-time overhead, GPT-2 small (12 layers, width 768, vocabulary 50257, 8 x 1024 tokens):
#      fp16 + GradScaler (with and without unscale_ + clip), fused AdamW + GradScaler, bf16 with
#      clipping, bf16 alone; plain, plain again (A/A) and ampdoctor's default, interleaved
#   2. the same on the reference GPT (4 layers, width 256: launch-bound, the worst case)
#   3. memory between steps and at peak (the CUDA allocator's), large-vocabulary LM
#   4. the GPU-marked tests: syncs per steady step under torch.cuda.set_sync_debug_mode,
#      output gradients released, step time from CUDA events, the deferred skip decision,
#      DeepSpeed's fp16 engine and Megatron-core's Float16OptimizerWithFloat16Params with its
#      DynamicGradScaler on CUDA (tests/integration/test_engines_recorded.py, where the
#      engines extra is installed: pip install -e '.[engines]'; skipped, saying so, if not)...
#   5. the fp8 path, on a GPU with fp8 matmuls (compute capability 8.9 and up: an H100): a tiny
#      run recorded in bf16 and with torchao's real fp8 matmuls (record --apply fp8), diagnosed
#      against each other, the readiness and the early warning printed (benchmarks/fp8_gpu.py;
#      one sentence and a skip on an older GPU or without torchao); then what the fp8 counts
#      cost a sampled step there (benchmarks/fp8_cost.py)
# and writes OUT/summary.md: docs/performance.md's GPU tables, as `overhead.py --markdown` prints them.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]                 # on the GPU machine
#   bash benchmarks/gpu_check.sh --device cpu [OUT_DIR]    # every path on tiny models, on CPU
#
# It uses the torch already installed there (a CUDA build) and this checkout on PYTHONPATH;
# nothing is installed or downloaded. A failing part is reported and the others still run;
# the exit status is non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
if [[ "${1:-}" == "--device" ]]; then
    device="${2:?--device needs cpu or cuda}"
    shift 2
fi
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
start=$SECONDS
scale=1  # time limits: a CPU smoke on a loaded machine gets four times longer
failed=()

part() {  # part NAME LIMIT_S COMMAND...: run, keep its output in OUT/NAME.txt, go on if it fails
    local name=$1 limit=$(($2 * scale))
    shift 2
    echo "== $name (limit ${limit} s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    local status=${PIPESTATUS[0]}
    if [[ $status -ne 0 ]]; then
        failed+=("$name (exit $status)")
    fi
}

python3 - "$device" <<'EOF' | tee "$out/device.txt" || exit 1
import importlib.util
import sys
missing = [m for m in ("torch", "numpy", "h5py", "click", "matplotlib", "pytest")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing modules {', '.join(missing)}: install them first")
import torch
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (run with --device cpu for the CPU smoke)")
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
          "capability", torch.cuda.get_device_capability())
else:
    print(torch.__version__, "CPU smoke: tiny models, every path")
EOF

if [[ $device == cuda ]]; then
    size=(); big=(--rounds 3 --steps 15 --warmup 5); small=(--rounds 7 --steps 30)
    memory=(--steps 30 --pairs 1)
    fp8=(--steps 30); fp8cost=(--rounds 3 --steps 10)
else
    size=(--smoke); big=(--rounds 1 --steps 4 --warmup 1); small=(--rounds 1 --steps 4 --warmup 1)
    memory=(--steps 6 --pairs 1)
    fp8=(--steps 12); fp8cost=(--smoke)
    scale=4
fi
bench=(python3 benchmarks/overhead.py --device "$device" ${size[@]+"${size[@]}"})
part gpt2 95 "${bench[@]}" --workload gpt2 "${big[@]}" --json "$out/gpt2.json"
part tiny 45 "${bench[@]}" --workload gpt "${small[@]}" --json "$out/tiny.json"
part memory 60 "${bench[@]}" --memory --workload lm --config fused,bf16 "${memory[@]}" \
    --json "$out/memory.json"
part tests 100 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts= tests  # one GPU: serial
part fp8 150 python3 benchmarks/fp8_gpu.py --device "$device" --out "$out/fp8" "${fp8[@]}"
part fp8_cost 90 python3 benchmarks/fp8_cost.py --device "$device" "${fp8cost[@]}"

jsons=()
for name in gpt2 tiny memory; do
    [[ -s "$out/$name.json" ]] && jsons+=("$out/$name.json")
done
if [[ ${#jsons[@]} -gt 0 ]]; then
    python3 benchmarks/overhead.py --markdown "${jsons[@]}" > "$out/summary.md"
    cat "$out/summary.md"
fi
echo "gpu_check: $((SECONDS - start)) s on $device; results in $out/"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
