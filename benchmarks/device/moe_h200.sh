#!/bin/bash
# The MoE GPU run behind benchmarks/results/h200/moe.json, on an nvidia-h200-x2 machine:
#   bash benchmarks/device/moe_h200.sh [tests|bench1|bench2 ...]   (default: all three)
# Logs go to $OUT (or ./device-logs). Expects .whl/ from ../shared/device/prep.sh.
source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
steps=${*:-tests bench1 bench2}
for step in $steps; do
  case $step in
    tests) CUDA_VISIBLE_DEVICES=0 timeout 240 python -m pytest -m gpu -q -x -p no:cacheprovider \
             tests/layers/test_moe_gpu.py tests/ops/test_moe_static_dispatch.py tests/ops/test_grouped_gemm_triton.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    bench1) CUDA_VISIBLE_DEVICES=0 timeout 300 python benchmarks/moe.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench1.log" | tail -30 ;;
    bench2) timeout 300 torchrun --nproc_per_node 2 benchmarks/moe.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench2.log" | tail -30 ;;
  esac
done
cp benchmarks/results/h200/moe.json "$OUT/" 2>/dev/null
save_triton_cache 2>/dev/null
true
