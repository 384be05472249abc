#!/usr/bin/env bash
# One-shot check of the Triton kernels on a CUDA machine (the lent H200), from the repository root:
#   bash benchmarks/gpu_check.sh            # results under $OUT (the device tool) or benchmarks/out
# Installs nothing: it needs python3 with torch, triton, transformers, pytest and scipy.
# 1. the kernel tests compiled on the GPU (no interpreter), GPU-marked ones included, and the
#    target's batched passes through the tree-attention kernel (~1-3 min, mostly compilation); 2. the benchmark of the verification kernels and compact_kv (~1-3 min);
#    3. the tree attention benchmark (~1-2 min), in its own JSON. Each step has its own time limit
#    (270 + 200 + 120 s), so the whole run stays under 10 minutes, and a failing step does not stop
#    the next one; the benchmark rewrites its JSON after each op group, so a step cut short keeps
#    what it measured.
# Focus a short run with TESTS (test files) and BENCH_OPS (op groups of benchmarks/kernels.py; ""
# skips step 2), e.g. for tree attention only:
#   TESTS="tests/test_kernel_tree_attention.py tests/test_kernel_hf_attention.py" BENCH_OPS="" \
#     bash benchmarks/gpu_check.sh
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
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 270 "$PY" -m pytest ${TESTS:-tests/test_kernel_*.py tests/test_target_batching.py} -q -rs -p no:cacheprovider --durations=10 -o addopts="" \
  2>&1 | tee "$out/tests.log" || status=1
ops="${BENCH_OPS-verify,tree,compact_kv}"
if [ -n "$ops" ]; then
  timeout 200 "$PY" benchmarks/kernels.py --ops "$ops" --json "$out/kernels.json" 2>&1 | tee "$out/benchmark.log" \
    || status=1
fi
timeout 120 "$PY" benchmarks/kernels.py --ops tree_attention --json "$out/tree_attention.json" 2>&1 \
  | tee "$out/tree_attention.log" || status=1
echo "gpu_check: $([ $status = 0 ] && echo OK || echo FAILED) (logs and JSON in $out)"
exit $status
