#!/bin/bash
# The GPU run behind benchmarks/results/h200/linear_attention_recurrent.json, on an nvidia-h200:
#   bash benchmarks/device/linear_attention_recurrent_h200.sh [build tests bench sanitizer ...]
# (default: all four, in that order). Logs go to $OUT (or ./device-logs). Expects .whl/ from
# ../shared/device/prep.sh (fla 0.6.0 is the anchor).
[ -n "${TRITON_CACHE_DIR:-}" ] || source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
TESTS=tests/ops/test_linear_attention_recurrent.py
steps=${*:-build tests bench sanitizer}
for step in $steps; do
  start=$SECONDS
  case $step in
    build) MAX_JOBS=16 python setup.py build_ext --inplace > "$OUT/build.log" 2>&1
           python -c "from megatron_moe_hybrid import _ext; assert _ext.has_cuda_ops(), 'no CUDA ops'" \
             || { tail -40 "$OUT/build.log"; exit 1; } ;;
    tests) timeout 70 python -m pytest -q -rfP -m "gpu and not slow" -p no:cacheprovider $TESTS \
             > "$OUT/gpu_tests.log" 2>&1; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -5 ;;
    bench) timeout 90 python benchmarks/linear_attention_recurrent.py --out "$OUT/linear_attention_recurrent.json" \
             2>&1 | tee "$OUT/bench.log" ;;
    sanitizer) timeout 100 python -m pytest -q -rf -m gpu -k sanitizer -p no:cacheprovider $TESTS \
                 > "$OUT/sanitizer.log" 2>&1; tail -5 "$OUT/sanitizer.log" ;;
  esac
  echo "step $step: $((SECONDS - start)) s"
done
true
