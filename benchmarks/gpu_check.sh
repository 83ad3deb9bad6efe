#!/usr/bin/env bash
# GPU check, for a machine with CUDA (the device machine when one is lent): the overhead
# benchmark on CUDA in fp16 and bf16, and the GPU-marked tests. Under 5 minutes on one GPU.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# It uses the torch already installed there (a CUDA build) and installs ampdoctor without
# dependencies, so nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
python3 -m pip install -q --no-deps -e . 2>&1 | tail -1 || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 200 python3 benchmarks/overhead.py --device cuda --dtype bfloat16 --rounds 7 --steps 40 \
    --json "$out/overhead_bf16.json" | tee "$out/overhead_bf16.txt"
timeout 60 python3 benchmarks/overhead.py --device cuda --dtype float16 --workload gpt --rounds 5 \
    --steps 30 --json "$out/overhead_fp16.json" | tee "$out/overhead_fp16.txt"
timeout 60 python3 benchmarks/overhead.py --device cuda --memory --workload gpt --pairs 2 \
    | tee "$out/memory.txt"
timeout 120 python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.txt"
