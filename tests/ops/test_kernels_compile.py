"""Our Triton kernels compiled for the H200 (sm_90a) on the CPU: tools/compile_kernels.py and
ops/_aot.py. The interpreter runs the kernels' arithmetic in the other tests; these check what
it cannot: that each launch the host code makes compiles for the GPU and fits in its shared
memory, for every kernel of the package at the benchmarks' shapes, and under each switch of the
linear attention built but not yet timed on the device."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "compile_kernels.py")
H200_SHARED = 227 * 1024

# The kernels one forward+backward launches at every shape (the split's segment scan and the
# group sums only at some).
KERNELS = {
    "gdn": {"_prep_kernel", "_recurrence_fwd_kernel", "_recurrence_bwd_kernel", "_bwd_chunk_kernel",
            "_bwd_chunk_gdn_w_kernel"},
    "gla": {"_recurrence_fwd_kernel", "_recurrence_bwd_kernel", "_bwd_chunk_kernel"},
}


def compile_kernels(tmp_path, *args):
    """(returncode, printed lines, JSON rows) of the tool run as a user runs it: its own process,
    without the interpreter that this pytest process sets (tests/conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, TOOL, *args, "--json", str(out)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=900)
    lines = [l for l in r.stdout.splitlines() if l.strip()]
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    if r.returncode not in (0, 1):
        raise AssertionError(f"tools/compile_kernels.py {args} exited {r.returncode}:\n{r.stdout}\n{r.stderr[-3000:]}")
    return r.returncode, lines, rows


def assert_all_fit(rc, lines, rows, ops, shapes, kernels=KERNELS):
    assert rc == 0 and not [l for l in lines if "FAILED" in l], "\n".join(lines)
    for op in ops:
        for shape in shapes:
            got = {r["kernel"] for r in rows if (r["op"], r["shape"]) == (op, shape)}
            assert kernels[op] <= got, (op, shape, sorted(got))
    for r in rows:
        assert r["shared_bytes"] <= H200_SHARED and r["registers"] <= 255 and r["programs_per_sm"] >= 1, r


def launched_kernels() -> set:
    """The @triton.jit functions of the package that some host code launches (name[grid](...)):
    every kernel, not the jit helpers they call."""
    names = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "megatron_moe_hybrid")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    src = fh.read()
                names |= {n for n in re.findall(r"@triton\.jit[^\n]*\n\s*def (\w+)\(", src) if n.endswith("_kernel")}
    return names


def test_every_kernel_compiles_for_the_h200(tmp_path):
    """One run over every op family at shapes that reach each of its kernels (the linear ops at
    the Qwen shape with grouped heads, TP=8 with the sequence split, packed; sparse attention's
    two forms; the loss, MoE, the linear layer's norms and conv, the indexer): every launch
    compiles and fits, and every kernel of the package is among them, so a new kernel needs a
    recorder in tools/compile_kernels.py."""
    shapes = ["qwen", "tp8", "varlen", "gqa8k", "mla", "v152k", "S1", "dsv32"]
    rc, lines, rows = compile_kernels(tmp_path, "--op", "gdn,gla,sparse,loss,moe,layer,indexer",
                                      "--shape", ",".join(shapes))
    assert_all_fit(rc, lines, rows, ["gdn", "gla"], ["qwen", "tp8", "varlen"])
    assert {"_segment_scan_kernel", "_group_sum_kernel"} <= {r["kernel"] for r in rows if r["shape"] == "tp8"}
    # on the GPU auto takes the sparse attention's fused backward at GQA and the products at MLA:
    # the dq and dk/dv kernels run where BACKWARD_FORM asks for the kernels form
    # (test_sparse_attention_kernels_form_compiles_for_the_h200_at_mla)
    missing = launched_kernels() - {r["kernel"] for r in rows} - {"_bwd_dq_kernel", "_bwd_dkv_kernel"}
    assert not missing, f"kernels no recorder of tools/compile_kernels.py launches: {sorted(missing)}"


@pytest.mark.parametrize("settings", [
    # the TMA stores together: simple GLA's whole-state sweep took 238600 B of shared memory at
    # three stages before _sweep_fwd capped it at two; the delta rule's groups summed apart (its
    # default until 2026-12-05)
    ["STATES_TMA=True", "O_TMA=True", "FUSE_GROUP_SUM.gdn=False"],
    ["GDN_SPLIT_CHUNK_BWD=False", "GDN_KEEP_PREP=False", "KEEP_STATES={'gla': False, 'gdn': False}",
     "GLA_KEEP_P=False", "GLA_DV_FROM_DH=False"],
], ids=["tma-group_sum", "fused-unkept"])
def test_linear_attention_kernels_compile_for_the_h200_under_each_switch(settings, tmp_path):
    shapes = ["h32", "varlen"]
    args = [a for s in settings for a in ("--set", s)]
    rc, lines, rows = compile_kernels(tmp_path, "--op", "gdn,gla", "--shape", ",".join(shapes), *args)
    fused = "GDN_SPLIT_CHUNK_BWD=False" in settings  # the delta rule's chunk backward in one kernel
    kernels = {**KERNELS, "gdn": KERNELS["gdn"] - {"_bwd_chunk_gdn_w_kernel"}} if fused else KERNELS
    assert_all_fit(rc, lines, rows, ["gdn", "gla"], shapes, kernels)
    assert fused != any(r["kernel"] == "_bwd_chunk_gdn_w_kernel" for r in rows)
    if "O_TMA=True" in settings:  # the descriptors were made: the kernels took them
        whole = [r for r in rows if r["kernel"] == "_recurrence_fwd_kernel" and r["constexprs"].get("O_TMA")]
        assert whole and all(r["constexprs"]["H_TMA"] for r in whole if r["op"] == "gla"), rows


def test_sparse_attention_kernels_form_compiles_for_the_h200_at_mla(tmp_path):
    """The kernels form at MLA's 128 heads (auto takes the products form there on the GPU). The
    indexer target's first config needs more shared memory than a block may take: its launch
    raises OutOfResources as on the device, and sparse attention's _launch takes the next
    config, which fits."""
    rc, lines, rows = compile_kernels(tmp_path, "--op", "sparse", "--shape", "mla", "--set",
                                      "FORWARD_FORM='kernels'", "--set", "BACKWARD_FORM='kernels'")
    assert rc == 0 and not [l for l in lines if "FAILED" in l], "\n".join(lines)
    assert {"_fwd_kernel", "_target_kernel", "_bwd_dq_kernel", "_bwd_dkv_kernel",
            "_bwd_reduce_kernel"} <= {r["kernel"] for r in rows}
    rejected = json.loads((tmp_path / "rows.json").read_text())["rejected"]
    assert [r["kernel"] for r in rejected] == ["_target_kernel"] and rejected[0]["shared_bytes"] > H200_SHARED
    assert any("_target_kernel" in l and "the host code took its next config" in l for l in lines), lines
    for r in rows:
        assert r["shared_bytes"] <= H200_SHARED and r["programs_per_sm"] >= 1, r


def test_sparse_attention_fused_backward_compiles_for_the_h200(tmp_path):
    """BACKWARD_FORM "fused" (_bwd_fused_kernel instead of the dq and dk/dv kernels) at GQA's 16
    heads per kv group and absorbed MLA's 32 under TP 4: every launch compiles and fits, none of
    the two kernels it replaces runs, and GQA's first config needs no second try (Triton 3.9 here;
    3.6, the H200's, gives 226 registers, none spilled, at gqa32k)."""
    rc, lines, rows = compile_kernels(tmp_path, "--op", "sparse", "--shape", "gqa8k,mla-h32", "--set",
                                      "FORWARD_FORM='kernels'", "--set", "BACKWARD_FORM='fused'")
    assert rc == 0 and not [l for l in lines if "FAILED" in l], "\n".join(lines)
    for shape in ("gqa8k", "mla-h32"):
        kernels = {r["kernel"] for r in rows if r["shape"] == shape}
        assert {"_fwd_kernel", "_bwd_fused_kernel", "_bwd_reduce_kernel"} <= kernels, (shape, kernels)
        assert not kernels & {"_bwd_dq_kernel", "_bwd_dkv_kernel"}, (shape, kernels)
    rejected = json.loads((tmp_path / "rows.json").read_text())["rejected"]
    assert not [r for r in rejected if r["kernel"] == "_bwd_fused_kernel"], rejected
    for r in rows:
        assert r["shared_bytes"] <= H200_SHARED and r["programs_per_sm"] >= 1, r


def test_a_launch_that_cannot_run_on_the_h200_fails_by_name(tmp_path):
    """fp32 tiles at head dim 128 (which the op refuses on CUDA for this reason) overflow the
    sweeps' shared memory: the recorded launch raises OutOfResources as on the device, which the
    linear-attention host code does not catch; a register cap too low for an instruction fails
    in ptxas. Each names the kernel, and the tool exits 1."""
    rc, lines, _ = compile_kernels(tmp_path, "--op", "gdn", "--shape", "b4", "--dtype", "float32")
    failed = [l for l in lines if "FAILED" in l]
    assert rc == 1 and failed, lines
    assert any("_recurrence_fwd_kernel" in l and "OutOfResources" in l and "shared memory" in l for l in failed), failed
    rc, lines, _ = compile_kernels(tmp_path, "--op", "gdn", "--shape", "b4", "--set", "CONFIGS.prep=(None, 4, 24)")
    failed = [l for l in lines if "FAILED" in l]
    assert rc == 1 and len(failed) == 1 and "_prep_kernel" in failed[0] and "registers" in failed[0], lines


@pytest.mark.parametrize("args, message", [
    (["--set", "NO_SUCH=1"], "triton_chunk has no switch NO_SUCH"),
    (["--set", "FUSE_GROUP_SUM.xyz=True"], "FUSE_GROUP_SUM has no entry 'xyz'"),
    (["--set", "O_TMA=whole"], "is not a Python literal"),
    (["--shape", "nope"], "--shape: unknown ['nope']"),
    (["--op", "gdn,sparse", "--shape", "qwen"], "none of ['qwen'] is a shape of --op sparse"),
    (["--op", "sparse", "--set", "STATES_TMA=True"], "triton_sparse has no switch STATES_TMA"),
    (["--op", "sparse", "--shape", "gqa8k", "--dtype", "float32"], "takes bf16 or fp16 on the GPU"),
])
def test_bad_arguments_are_named(args, message, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_against_a_revision_compares_the_sass_launch_by_launch(tmp_path):
    """--against HEAD: the package of HEAD (a temporary worktree) and this checkout recorded and
    compiled alike; in a clean checkout every launch compiles to the same SASS (exit 0), with a
    kernel edited since HEAD some differ (exit 2)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, TOOL, "--op", "gla", "--shape", "tp8", "--against", "HEAD"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    summary = [l for l in r.stdout.splitlines() if "compile to the same SASS as at HEAD" in l]
    assert r.returncode in (0, 2) and len(summary) == 1, r.stdout[-3000:] + r.stderr[-3000:]
    launches, same = (int(x) for x in re.findall(r"(\d+) launches, (\d+) compile", summary[0])[0])
    assert launches >= 8 and (same == launches) == (r.returncode == 0), summary


def test_compare_says_which_launches_differ(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from compile_kernels import compare

    a = [("gla", "tp8", "_prep_kernel", "aa"), ("gla", "tp8", "_bwd_chunk_kernel", "bb")]
    assert compare(a, list(a), "REV") == 0
    assert compare(a, [a[0], a[1][:3] + ("cc",)], "REV") == 2
    assert "gla tp8 _bwd_chunk_kernel: SASS bb at REV, cc here" in capsys.readouterr().out
    assert compare(a, a[:1], "REV") == 2
    assert "the launches differ: REV made 2, this checkout 1" in capsys.readouterr().out


def test_programs_per_sm():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from compile_kernels import programs_per_sm

    assert programs_per_sm(209, 8, 114688) == 1  # registers: 6912 a warp, 55296 of 65536
    assert programs_per_sm(209, 4, 114688) == 2  # and shared memory: 2 x (112 + 1) KB of 228
    assert programs_per_sm(128, 8, 65536) == 2
    assert programs_per_sm(80, 4, 33024) == 6
    assert programs_per_sm(38, 4, 0) == 12  # 38 registers round to 40: 1280 a warp
