import os

import pytest

# Keep CPU tests fast and reproducible on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Without a GPU, Triton kernels run in its interpreter. The flag is read when a kernel is
# decorated, so it must be set before any test module imports one.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The slow set (`make test-all`; `make test`, which CI runs, leaves it out to stay under 30
# minutes on 2 cores): besides the tests marked @pytest.mark.slow in their files, these, each a
# variant or a wider twin of a test that stays in the quick set (seconds on 2 cores, 2026-12-06).
SLOW_TESTS = {
    "tests/models/test_model_context_parallel.py::test_cp2_model_equals_cp1[seq-gated-attention]",  # 25 s; [packed-mla-gated-attention] stays (the CP layer tests run unpacked)
    "tests/training/test_train.py::test_cp2_equals_cp1",  # 42 s; CP: test_model_context_parallel, prompt_response
    "tests/training/test_train.py::test_ep2_equals_ep1",  # 28 s; test_fsdp's W2-DP2-EP2 trains EP=2 against one process
    "tests/training/test_eval.py::test_eval_under_ep2_cp2_and_fsdp2_equals_one_process",  # 41 s
    "tests/training/test_faults.py::test_torchrun_ranks_wait_for_a_first_tokenization_longer_than_the_collective_timeout",  # 34 s
    "tests/training/test_faults.py::test_bad_jsonl_lines_error_or_are_counted",  # 18 s; test_bad_data covers each case
    "tests/training/test_prompt_response.py::test_isolated_records_under_cp2_equal_one_process",  # 21 s
    "tests/models/test_model_context_parallel.py::test_cp2_model_equals_cp1[micro_batch]",  # 25 s; [packed-mla-gated-attention] stays
    "tests/ops/test_kernels_compile.py::test_against_a_revision_compares_the_sass_launch_by_launch",  # 23 s
    "tests/ops/test_kernels_compile.py::test_linear_attention_kernels_compile_for_the_h200_under_each_switch[tma-group_sum]",
    "tests/ops/test_kernels_compile.py::test_linear_attention_kernels_compile_for_the_h200_under_each_switch[fused-unkept]",
    "tests/tools/test_convert_checkpoint.py::test_dcp_saved_from_ep2_equals_ep1_and_exports_to_hf",  # 13 s
    "tests/tools/test_plan.py::test_expert_parallel_rows_and_saved_bytes_are_planned[1.25]",  # 17 s; [2.0] stays
    "tests/tools/test_plan.py::test_planned_peak_at_expert_parallel_is_within_10_percent_of_measured[full-f1]",
    "tests/tools/test_plan.py::test_planned_peak_at_expert_parallel_is_within_10_percent_of_measured[full-f2]",
    "tests/test_bench_end_to_end_smoke.py::test_ep2_run_equals_one_process_on_the_global_batch",  # 28 s
    "tests/test_bench_sparse_forms.py::test_forms_time_the_fused_backward_at_each_sweep_config",  # 19 s
    "tests/layers/test_moe_layer.py::test_expert_parallel_matches_single_process[exact]",  # 17 s; [static] stays
    "tests/layers/test_moe_layer.py::test_expert_parallel_matches_single_process[static-chunks3]",
    "tests/ops/test_sparse_attention_triton.py::test_fused_backward_equals_the_two_kernels_cpu[B2-T9-S30-H4-G2-D24-DV20-K19]",
    "tests/ops/test_sparse_attention_triton.py::test_products_forward_makes_the_kl_target_cpu[B2-T9-S30-H4-G2-D24-DV20-K19-True]",
    "tests/ops/test_sparse_attention_triton.py::test_products_forward_makes_the_kl_target_cpu[B1-T12-S12-H17-G1-D40-DV16-K20-False]",
    "tests/ops/test_sparse_indexer_triton.py::test_triton_sparse_index_scores_forward_and_gradients[20-40]",  # 15 s
    "tests/ops/test_sparse_indexer_triton.py::test_triton_sparse_index_scores_forward_and_gradients[3-24]",  # [1-16] stays
    "tests/ops/test_sparse_attention_triton.py::test_triton_matches_reference_cpu[B2-T9-S30-H4-G2-D24-DV20-K19-products]",
    "tests/ops/test_sparse_attention_triton.py::test_triton_matches_reference_cpu[B2-T9-S30-H4-G2-D24-DV20-K19-kernels+products]",
    "tests/parallel/test_cp_linear_attention.py::test_cp_ops_match_single_process_and_communication_is_independent_of_T",  # 19 s
    "tests/training/test_train.py::test_a_lora_run_started_by_train_is_a_finetune",  # 18 s
    # 27 s: the model-level twin stays (test_a_packed_micro_batch_equals_each_record_alone)
    "tests/training/test_prompt_response.py::test_an_isolated_training_step_is_the_packed_reference",
    # 33 s: an S layer under CP=2 stays in test_cp2_model_equals_cp1[packed-mla-gated-attention]
    "tests/parallel/test_cp_sparse_attention.py::test_cp_layer_equals_single_process",
    # 45-70 s with its fixture: a DCP checkpoint into FSDP2 shards; test_checkpoint's four ranks load
    # FSDP2 shards by rows, test_convert_checkpoint's DCP reshards under EP=2
    "tests/parallel/test_fsdp.py::test_lora_from_a_dist_checkpoint_under_fsdp",
    # the radix select in the interpreter (13-16 s each on 2 cores, 2026-12-07): digit widths 8, 11
    # and 12 stay; the kernel's ordering keeps [radix-kernel-1024]; _select_by_blocks over radix
    # keeps [8-radix]
    "tests/ops/test_sparse_indexer_triton.py::test_radix_thresholds[6-32]",
    "tests/ops/test_sparse_indexer_triton.py::test_select_rows_keeps_the_lowest_ties[radix-kernel-16]",
    "tests/ops/test_sparse_indexer_triton.py::test_select_by_blocks_equals_select_rows[3-radix]",
} | {  # the linear attention's Triton kernels in the interpreter: one variant of each test stays
    f"tests/ops/test_linear_attention_triton.py::{name}"
    for name in [
        *(f"test_chunk_states_written_by_tma_are_bitwise_the_plain_stores_cpu[{v}]"  # STATES_TMA is off by default
          for v in ("True-gated_delta_rule", "False-gated_delta_rule", "True-simple_gla-light", "True-simple_gla-whole",
                    "False-simple_gla-whole")),
        *(f"test_output_written_by_tma_is_bitwise_the_plain_stores_cpu[{v}]"
          for v in ("B2-T128-False-gated_delta_rule", "varlen-64-0-128-True-gated_delta_rule",
                    "varlen-64-70-True-gated_delta_rule", "varlen-64-0-128-False-gated_delta_rule",
                    "varlen-64-70-False-gated_delta_rule", "B2-T128-True-simple_gla", "varlen-64-0-128-True-simple_gla",
                    "B2-T128-False-simple_gla", "varlen-64-0-128-False-simple_gla")),
        "test_backward_from_the_forwards_chunk_states_is_bitwise_the_same_cpu[False-gated_delta_rule]",
        "test_backward_from_the_forwards_chunk_states_is_bitwise_the_same_cpu[False-simple_gla-whole]",
        "test_grouped_heads_summed_in_the_chunk_kernel_cpu[varlen-gated_delta_rule-two-kernels]",
        "test_light_sweeps_take_blocks_of_the_key_dim_cpu[varlen-1]",
        "test_light_sweeps_take_blocks_of_the_key_dim_cpu[varlen-2]",
        "test_light_sweeps_take_blocks_of_the_key_dim_cpu[batch-2]",
        "test_gated_delta_rule_chunk_backward_in_two_kernels_cpu[varlen-H1-HV2-K32-V16-1]",
        "test_gated_delta_rule_chunk_backward_in_two_kernels_cpu[B2-T130-H2-K16-V32-1]",
        "test_sequence_split_matches_reference_cpu[2-varlen-130-0-1-200-H1-HV2-K32-V16-gated_delta_rule]",
        "test_sequence_split_matches_reference_cpu[2-B2-T200-H1-HV2-K16-V32-gated_delta_rule]",
    ]
}


def pytest_collection_modifyitems(config, items):
    """SLOW_TESTS join the slow set; GPU tests are skipped where no CUDA device exists (CI,
    developer machines)."""
    if not config.option.file_or_dir:  # the whole suite (make test, CI): a renamed test must not leave the slow set
        missing = sorted(SLOW_TESTS - {item.nodeid for item in items})
        if missing:
            message = f"tests/conftest.py SLOW_TESTS names tests that do not exist: {missing}"
            if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller prints it
                config.workeroutput["usage_error"] = message
            raise pytest.UsageError(message)
    for item in items:
        if item.nodeid in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is a setup error reported elsewhere
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: a worker's usage error (make test), which it would not show."""
    message = getattr(node, "workeroutput", {}).get("usage_error")
    if message:
        node.config.pluginmanager.get_plugin("terminalreporter").write_line(f"{node.gateway.id}: {message}", red=True)


# Tests import the package from this checkout even where it is not pip-installed.
import sys  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
os.environ["PYTHONPATH"] = _ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")


@pytest.fixture(autouse=True)
def _verify_fast_launch_keys(request, monkeypatch):
    """In GPU tests every kernel launched through ops/_launch.py's cache is checked: a call whose
    key is cached takes Triton's own path and must get the cached compiled kernel back
    (_launch.VERIFY). Tests of the cached path itself set VERIFY back to False."""
    if "gpu" in request.keywords:
        from megatron_moe_hybrid.ops import _launch

        monkeypatch.setattr(_launch, "VERIFY", True)
