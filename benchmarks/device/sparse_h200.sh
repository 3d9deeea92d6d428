#!/bin/bash
# The sparse-attention GPU run behind benchmarks/results/h200/{sparse_attention,sparse_layer,mla_layer}.json,
# on one H200:
#   bash benchmarks/device/sparse_h200.sh [tests|attention|layer|mla|h32|sweep|kl ...]   (default: tests attention layer mla)
# Results and logs go to $OUT (or ./device-logs); copy the JSON rows into benchmarks/results/h200/ by hand
# (the device copy's git sha is stale: set git_sha / git_sha_of_row to the commit measured).
# Expects .whl/ from ../shared/device/prep.sh. About 6 minutes for the default steps.
source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
steps=${*:-tests attention layer mla}
for step in $steps; do
  case $step in
    tests) timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_sparse_attention_triton.py \
             tests/ops/test_sparse_indexer_triton.py tests/layers/test_mla_absorbed.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 ;;
    # each form of the sparse attention per shape (--forms: kernels, products, and where a kv group has at most
    # 64 heads the fused kernels backward at FUSED_SWEEP's configs), anchors included; MLA at 128k keys without them
    attention) (cd benchmarks && timeout 420 python sparse_attention.py --shapes mla,gqa8k,gqa32k --forms --out "$OUT/sa.json" &&
                timeout 100 python sparse_attention.py --shapes mla128k --forms --budget-s 0 --profile "$OUT/prof" \
                  --out "$OUT/sa128.json") 2>&1 | tee "$OUT/attention.log" | grep -v Warning | tail -12 ;;
    layer) (cd benchmarks && timeout 300 python sparse_layer.py --jobs mla128k,mla64k,mla32k,mla8k,gqa32k,gqa128k \
              --out "$OUT/sl.json") 2>&1 | tee "$OUT/layer.log" | grep "ours\|parts\|naive\|sdpa" | tail -24 ;;
    mla) (cd benchmarks && timeout 150 python mla_layer.py --out "$OUT/mla_layer.json") 2>&1 | tee "$OUT/mla.log" | tail -4 ;;
    # the kernels form at MLA with SWEEP's other launch configs (--sweep; the forward at 32 slots untimed so far)
    sweep) (cd benchmarks && timeout 200 python sparse_attention.py --shapes mla --sweep --budget-s 0 \
              --out "$OUT/sa_sweep.json") 2>&1 | tee "$OUT/sweep.log" | grep "sweep\|ours" | tail -8 ;;
    # the GQA layer's sparse-stage KL loss, kernel by kernel (66 ms of the layer's 264 at 32k, an unprofiled part)
    kl) timeout 150 python benchmarks/device/profile_kl.py "$OUT" 2>&1 | tee "$OUT/kl.log" | tail -24 ;;
    # absorbed MLA at TP=4 (32 heads per rank): where auto's form threshold (64 heads) is unmeasured
    h32) (cd benchmarks && timeout 120 python sparse_attention.py --shapes mla-h32 --forms --budget-s 0 \
            --out "$OUT/sa_h32.json") 2>&1 | tee "$OUT/h32.log" | grep "form\|ours" | tail -6 ;;
  esac
done
save_triton_cache 2>/dev/null
true
