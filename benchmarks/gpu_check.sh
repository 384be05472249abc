#!/usr/bin/env bash
# One-shot check of the Triton kernels on a CUDA machine (the lent H200), from the repository root:
#   bash benchmarks/gpu_check.sh            # results under $OUT (the device tool) or benchmarks/out
# Installs nothing: it needs python3 with torch, triton, pytest and scipy (the H200 image has them).
# 1. the kernel tests compiled on the GPU (no interpreter), GPU-marked ones included (~1-3 min,
#    mostly compilation); 2. the benchmark (~1-3 min). Each step has its own time limit, so the whole
#    run stays under ~8 minutes, and a failing step does not stop the next one.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
"$PY" -c "import torch, triton, sys; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "no CUDA here: nothing to check"; exit 2; }

out="${OUT:-benchmarks/out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu.txt"

status=0
timeout 300 "$PY" -m pytest tests/test_kernel_*.py -q -rs -p no:cacheprovider --durations=10 -o addopts="" \
  2>&1 | tee "$out/tests.log" || status=1
timeout 240 "$PY" benchmarks/kernels.py --json "$out/kernels.json" 2>&1 | tee "$out/benchmark.log" || status=1
echo "gpu_check: $([ $status = 0 ] && echo OK || echo FAILED) (logs and kernels.json in $out)"
exit $status
