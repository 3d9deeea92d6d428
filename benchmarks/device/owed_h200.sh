#!/bin/bash
# The H200 runs that earlier notes say are owed, in one device call, each step under a deadline:
#   source .whl/preamble.sh && export PYTHONPATH=$PWD:$PYTHONPATH && export -f save_triton_cache &&
#   DEADLINE=570 STEPS="layer idx loss" bash benchmarks/device/owed_h200.sh
# STEPS (default: all, in this order): layer (MLA / GQA layer at 128k keys with the listed radix
# selection), idx (the indexer at 128k / 1M keys, every selection form, bf16 and fp8), loss
# (issue 7's first shape), layer8 (the layer rows with fp8 index scores), dkl (the dense warm-up's
# fused KL loss), warmup (the dense warm-up step). A step is skipped where the DEADLINE (seconds
# from the start) leaves it under 30 s; each runs under its own timeout, cut to what is left.
# Logs and JSON go to $OUT (or ./device-logs); copy rows into benchmarks/results/h200/ by hand
# (set git_sha to the commit measured: the device copy's is stale). Expects .whl/ from
# ../shared/device/prep.sh.
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
STEPS=${STEPS:-layer idx loss layer8 dkl warmup}
DEADLINE=${DEADLINE:-570}
T0=$(date +%s)
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local left=$(( DEADLINE - ($(date +%s) - T0) - 25 ))
  (( left < 30 )) && { echo "skip $name (left $left s)"; return; }
  (( limit > left )) && limit=$left
  echo "== $name (limit $limit s) at $(( $(date +%s) - T0 )) s"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$? $name at $(( $(date +%s) - T0 )) s"
  grep -vi warn "$OUT/$name.log" | tail -14
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
step layer 260 bash -c "cd benchmarks && python sparse_layer.py --jobs mla128k,gqa128k --out $OUT/sl_layer.json"
step idx 250 bash -c "cd benchmarks && python sparse_layer.py --jobs idx128k,idx1m --fp8 --out $OUT/sl_idx.json"
step loss 300 python benchmarks/loss.py --quick --out "$OUT/loss.json"
step layer8 200 bash -c "cd benchmarks && python sparse_layer.py --jobs mla128k,gqa128k --fp8 --out $OUT/sl_layer8.json"
step dkl 200 python benchmarks/dense_indexer_kl.py --out "$OUT/dense_indexer_kl.json"
step warmup 200 python benchmarks/dense_warmup.py --out "$OUT/dense_warmup.json"
save_triton_cache > /dev/null 2>&1
echo "done at $(( $(date +%s) - T0 )) s"
