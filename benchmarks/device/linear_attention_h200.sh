#!/bin/bash
# The linear-attention GPU run behind benchmarks/results/h200/linear_attention.json, on one H200:
#   bash benchmarks/device/linear_attention_h200.sh [tests] [warm] [bench] [breakdown]   (default: tests warm bench)
# fla 0.6.0's first call of each op compiles and autotunes for 30-170 s per op and head count, which
# kept its anchor off most shapes for several sessions. "warm" compiles ours and fla at every shape
# in side-by-side processes (one per shape, about 145 s for the six delta-rule shapes), then deletes
# the autotune choices they made under that contention (Triton's *.autotune.json; fla caches them,
# FLA_CACHE_RESULTS=1), so that "bench" makes them again alone from the cached binaries (about 10 s
# per op and shape). End with save_triton_cache and keep the cache (../shared/device/keep-cache.sh):
# the next run then skips both. Results and logs go to $OUT (or ./device-logs); the JSON there
# starts from the committed one (--merge); copy it back by hand and set git_sha / git_sha_of_row
# to the commit measured (the device copy's sha is stale). OPS (default gdn,gla) and SHAPES
# (default all) narrow the run.
source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
OPS=${OPS:-gdn,gla}; SHAPES=${SHAPES:-all}
steps=${*:-tests warm bench}
for step in $steps; do
  case $step in
    tests) timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_linear_attention_triton.py 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -4 ;;
    warm)
      t0=$(date +%s)
      for pair in $(cd benchmarks && python -c "
import linear_attention as b
want = None if '$SHAPES' == 'all' else set('$SHAPES'.split(','))
print(' '.join(f'{op}:{key}' for op in '$OPS'.split(',') for key in b.OP_SHAPES[op] if want is None or key in want))"); do
        (cd benchmarks && python - "${pair%%:*}" "${pair##*:}" > "$OUT/warm_${pair/:/_}.log" 2>&1 <<'PY') &
import sys, torch
import linear_attention as b
op, key = sys.argv[1:]
shape, B, T, H, HV, D, lengths = b.SHAPES[key]
x, cu = b.make_inputs(op, B, T, H, HV, D, lengths)
do = torch.randn(B, T, HV, D, device="cuda").bfloat16()
for fn in (b.ours_fn(op, cu), b.fla_fn(op, cu)):
    o = fn(x)
    torch.autograd.grad(o, list(x.values()), do)
    torch.cuda.synchronize()
print("compiled", op, key)
PY
      done
      wait
      echo "warm: $(( $(date +%s) - t0 )) s; autotune choices dropped: $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l)"
      find "$TRITON_CACHE_DIR" -name '*.autotune.json' -delete ;;
    bench)
      [ -f "$OUT/linear_attention.json" ] || cp benchmarks/results/h200/linear_attention.json "$OUT/linear_attention.json"
      (cd benchmarks && python linear_attention.py --ops "$OPS" --shapes "$SHAPES" --merge --out "$OUT/linear_attention.json") 2>&1 \
        | tee "$OUT/bench_${OPS//,/_}_${SHAPES//,/_}.log" | grep "fwd+bwd\|wrote" ;;
    breakdown) (cd benchmarks && python linear_attention.py --ops gdn --shapes qwen --skip-fla --breakdown \
                  --out "$OUT/breakdown.json") 2>&1 | grep "^breakdown" | tee "$OUT/breakdown.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
