#!/bin/bash
# Every GPU-marked test (pytest -m gpu) on one H200, in groups, each under its own time limit so
# a slow group cannot take the rest's log with it:
#   bash benchmarks/device/gpu_tests_h200.sh [sparse|loss|moe|model|linear ...]   (default: all, about 17 minutes
#   from a cold Triton cache: run "sparse loss moe" and "model linear" as two device calls)
# Logs go to $OUT (or ./device-logs): gpu_<group>.log, and gpu_summary.log with each group's last line.
# Expects .whl/ from ../shared/device/prep.sh.
source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
steps=${*:-sparse loss moe model linear}
run() {  # group, limit in seconds, test files
  local group=$1 limit=$2; shift 2
  timeout "$limit" python -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5 "$@" > "$OUT/gpu_$group.log" 2>&1
  echo "$group (rc $?): $(grep -E '[0-9]+ (passed|failed)' "$OUT/gpu_$group.log" | tail -1)" | tee -a "$OUT/gpu_summary.log"
}
for step in $steps; do
  case $step in
    sparse) run sparse 360 tests/ops/test_sparse_attention_triton.py tests/ops/test_sparse_indexer_triton.py tests/ops/test_causal_attention_gpu.py \
              tests/ops/test_dense_indexer_kl.py tests/layers/test_mla_absorbed.py ;;
    loss) run loss 90 tests/ops/test_cross_entropy_triton.py tests/ops/test_cublaslt.py ;;
    moe) run moe 120 tests/ops/test_fused_permute.py tests/layers/test_moe_gpu.py tests/ops/test_grouped_gemm_triton.py \
           tests/layers/test_moe_router.py tests/ops/test_moe_static_dispatch.py tests/ops/test_moe_router_triton.py \
           tests/ops/test_moe_swiglu.py tests/ops/test_fast_launch_gpu.py ;;
    model) run model 300 tests/layers/test_lora.py tests/training/test_train_gpu.py tests/models/test_model_context_parallel.py tests/training/test_checkpoint.py \
             tests/parallel/test_offload.py ;;
    linear) run linear 300 tests/ops/test_linear_attention_triton.py tests/ops/test_linear_attention_recurrent.py \
              tests/ops/test_linear_attention_norms.py tests/ops/test_short_conv.py ;;
  esac
done
save_triton_cache 2>/dev/null
true
