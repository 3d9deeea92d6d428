#!/bin/bash
# The linear + cross-entropy GPU run behind benchmarks/results/h200/loss.json, on one H200:
#   bash benchmarks/device/loss_h200.sh [tests|bench ...]   (default: both; about 4 minutes)
# tests: the loss's bf16 GPU tests (the gradient scaling of _scale_kernel among them); bench:
# benchmarks/loss.py at both shapes, trainable and frozen, against Liger, CCE and naive torch in the
# same process, each row with scale_ab (the backward's scaling on the device against torch's mul_).
# Results and logs go to $OUT (or ./device-logs); copy the rows into benchmarks/results/h200/ by
# hand (set git_sha to the commit measured). Expects .whl/ from ../shared/device/prep.sh.
source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
steps=${*:-tests bench}
for step in $steps; do
  case $step in
    tests) timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_cross_entropy_triton.py \
             tests/ops/test_cublaslt.py 2>&1 | tee "$OUT/loss_gpu_tests.log" | tail -8 ;;
    bench) timeout 420 python benchmarks/loss.py --out "$OUT/loss.json" 2>&1 | tee "$OUT/loss.log" | tail -16 ;;
  esac
done
save_triton_cache 2>/dev/null
true
