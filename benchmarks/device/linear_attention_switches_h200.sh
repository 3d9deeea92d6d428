#!/bin/bash
# The switches of triton_chunk that were built and CPU-tested before they were timed, in one H200 call
# (run on 2026-12-05, the rows "(A/B)" of results/h200/linear_attention.json; O_TMA "whole", the delta
# rule's grouped sums, the prep kernel at 168 registers and the packed recurrences at 8 warps won and
# are the defaults since; probe_gla_switch.py sets both forms itself, probe_gla_configs.py compares
# each variant with the current defaults, so its lines below now time the earlier defaults as the
# variants: the prep kernel uncapped (prep_4), the packed recurrences at 4 warps):
#   bash benchmarks/device/linear_attention_switches_h200.sh      (about 5-7 minutes; no fla)
# 1. the linear-attention GPU tests, theirs among them (the TMA stores: STATES_TMA, O_TMA; the
#    delta rule's grouped-head sums in its two-kernel backward: FUSE_GROUP_SUM["gdn"], whose
#    second kernel's source changed for GROUP): bf16 against the fp32 reference and bitwise
#    against the plain forms;
# 2. each against the default in one process (probe_gla_switch.py, probe_gla_configs.py; ours
#    only, no fla): the TMA stores at "whole" for simple GLA's long shapes, where its whole-state
#    split runs (both together at two pipeline stages: at three that sweep needs more shared
#    memory than a block may take, tools/compile_kernels.py), then each of the two apart; the
#    grouped sums for the delta rule at its grouped shapes; the delta rule's forward prep kernel
#    under a register cap, its chunk backward at 2 stages, its unsplit recurrences past one wave
#    at 8 warps.
# Rows go to $OUT/switches_*.json (merge by hand into results/h200/linear_attention.json); a switch
# that wins becomes the default, and linear_attention_h200.sh then times the defaults beside fla.
source .whl/preamble.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-$PWD/device-logs}; mkdir -p "$OUT"
timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_linear_attention_triton.py 2>&1 \
  | tee "$OUT/switches_gpu_tests.log" | tail -3
cd benchmarks || exit 1
for switch in tma states_tma o_tma; do
  timeout 150 python device/probe_gla_switch.py --switch $switch --op gla --shapes h32,qwen,gla_t32k,varlen \
    --out "$OUT/switches_gla_$switch.json" 2>&1 | grep '^{' | tee -a "$OUT/switches.log"
done
timeout 150 python device/probe_gla_switch.py --switch group_sum --op gdn --shapes qwen,varlen,tp8 \
  --out "$OUT/switches_gdn_group_sum.json" 2>&1 | grep '^{' | tee -a "$OUT/switches.log"
# the delta rule's forward prep kernel (217 registers at 4 warps uncapped: two programs per SM; the
# default caps it at 168 for three) uncapped and capped for four (128); its two chunk-backward kernels
# at 2 pipeline stages (the fused kernel alone ran 1.026x so at B4-T8192-H16,
# linear_attention_chunk_bwd_config.json); each against the default (probe_gla_configs.py: defaults
# and variants in turn)
timeout 200 python device/probe_gla_configs.py --op gdn --variants prep_4,prep_4r128,chunk_64x8s2 --shapes qwen,b4 \
  --out "$OUT/switches_gdn_prep_maxnreg.json" 2>&1 | grep '^{' | tee -a "$OUT/switches.log"
# the delta rule's unsplit recurrences past one wave (CONFIGS["seq_wide"], BV 64) at 8 warps: 228
# and 210 registers a thread, against 255 (the cap) at the default 4 warps (tools/compile_kernels.py
# with Triton 3.6, --set "CONFIGS.seq_wide=(64, 8)"); packed, CONFIGS["seq_wide_varlen"] (8 warps
# since 2026-12-05, where 4 spill) at the earlier 4
timeout 150 python device/probe_gla_configs.py --op gdn --variants cfg_seq_wide_64x8 --shapes b4,h96 \
  --out "$OUT/switches_gdn_seq_wide.json" 2>&1 | grep '^{' | tee -a "$OUT/switches.log"
timeout 100 python device/probe_gla_configs.py --op gdn --variants cfg_seq_wide_varlen_64x4 --shapes varlen \
  --out "$OUT/switches_gdn_seq_wide_varlen.json" 2>&1 | grep '^{' | tee -a "$OUT/switches.log"
