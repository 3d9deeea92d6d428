"""Checkpoints: atomic directories, no pickle on load, global expert names."""

import os

import pytest
import torch

from megatron_moe_hybrid.testing import checkpoint_tensors, init_megatron, teardown, tiny_config
from megatron_moe_hybrid.training import checkpoint as ckpt


@pytest.fixture(scope="module", autouse=True)
def megatron_state():
    init_megatron()
    yield
    teardown()


def build(seed=0):
    from megatron_moe_hybrid.models import build_model

    torch.manual_seed(seed)
    return build_model(tiny_config(**{"model.num_layers": 4}))


def test_save_load_round_trip_and_expert_names(tmp_path):
    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 7, model, {"step": 7}, {"note": "x"})
    assert os.path.basename(path) == "step_00000007"
    assert ckpt.latest_checkpoint(str(tmp_path)) == path
    from safetensors import safe_open

    names = set()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                names |= set(h.keys())
    # experts are stored one tensor per global expert
    assert "decoder.layers.0.mlp.experts.weight1.expert7" in names
    assert "decoder.layers.0.mlp.experts.weight1" not in names

    other = build(1)
    first = next(iter(other.state_dict()))
    assert not torch.equal(model.state_dict()[first], other.state_dict()[first])
    ckpt.load_model_weights(path, other)
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), n
    assert ckpt.load_rank_state(path) == {"step": 7}


def test_incomplete_checkpoints_are_ignored_and_cleaned(tmp_path):
    model = build(0)
    root = tmp_path / ckpt.CKPT_DIR
    good = ckpt.save_checkpoint(str(tmp_path), 5, model, {"step": 5}, {})
    # a save killed half-way: a .tmp- directory, and a step directory without meta.json
    (root / ".tmp-step_00000010").mkdir()
    (root / ".tmp-step_00000010" / "model-ep00000-r00000.safetensors").write_bytes(b"partial")
    (root / "step_00000009").mkdir()
    assert ckpt.latest_checkpoint(str(tmp_path)) == good
    with pytest.raises(ckpt.CheckpointError, match="meta.json"):
        ckpt.load_model_weights(str(root / "step_00000009"), model)
    ckpt.save_checkpoint(str(tmp_path), 6, model, {"step": 6}, {})
    assert not (root / ".tmp-step_00000010").exists()


def test_keep_prunes_old_checkpoints(tmp_path):
    model = build(0)
    for step in (1, 2, 3):
        ckpt.save_checkpoint(str(tmp_path), step, model, {"step": step}, {}, keep=2)
    assert [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))] == ["step_00000002", "step_00000003"]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _resize_meta(path):
    """Records the files' current sizes, as a checkpoint written by another program would."""
    import json

    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["files"] = {name: os.path.getsize(os.path.join(path, name)) for name in meta["files"]}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def _set_meta(path, **fields):
    import json

    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    meta.update(fields)
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_another_layout_resumes_only_with_optimizer_files(tmp_path, monkeypatch):
    """A checkpoint whose moments are in each rank's state file (as earlier versions wrote) keeps
    its layout; one with optimizer files gives another layout the state of rank (rank mod its
    world size) and says it reshards. The moments loaded from the files equal the optimizer's."""
    model = build(0)
    optimizer = _stepped_adam(model)
    earlier = ckpt.save_checkpoint(str(tmp_path / "earlier"), 1, model, {"step": 1, "optimizer": optimizer.state_dict()}, {})
    assert ckpt.holds_moments(ckpt.load_rank_state(earlier)["optimizer"])
    _set_meta(earlier, world_size=2)  # as if 2 ranks had saved it
    with pytest.raises(ckpt.CheckpointError, match="saved with world size 2 and expert parallel 1, resumed with 1 and "
                       "1, and each of its ranks keeps its optimizer moments in its own state file"):
        ckpt.load_rank_state(earlier)
    scalars = ckpt.optimizer_scalars(optimizer.state_dict())
    assert not ckpt.holds_moments(scalars) and all(set(s) == {"step"} for s in scalars["state"].values())
    path = ckpt.save_checkpoint(str(tmp_path / "files"), 1, model, {"step": 1}, {}, optimizer=optimizer)
    _set_meta(path, world_size=2)
    state = ckpt.load_rank_state(path)
    assert state["resharded_from"] == "world size 2 and expert parallel 1" and state["step"] == 1
    assert state["optimizer"] == scalars  # the state file holds the step counts and param groups
    # rank 3 of the new layout takes saved rank 1's state file (3 mod 2): its RNG stream
    torch.save({"step": 1, "optimizer": scalars, "rng": torch.tensor([1])}, os.path.join(path, "state-rank00001.pt"))
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_rank", lambda: 3)
        assert ckpt.load_rank_state(path)["rng"].tolist() == [1]
    other = build(1)
    again = torch.optim.AdamW(other.parameters())
    ckpt.load_optimizer_state(path, other, again, state["optimizer"])
    for p, q in zip(model.parameters(), other.parameters()):
        assert set(again.state[q]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in again.state[q]:
            assert torch.equal(again.state[q][key], optimizer.state[p][key]), key
    # a moment gone from the optimizer file is named
    from safetensors.torch import load_file, save_file

    fname = os.path.join(path, "optim-ep00000-r00000.safetensors")
    tensors = load_file(fname)
    gone = sorted(tensors)[0]
    del tensors[gone]
    save_file(tensors, fname)
    _resize_meta(path)
    with pytest.raises(ckpt.CheckpointError, match=f"the optimizer files lack the moments \\['{gone}'\\]"):
        ckpt.load_optimizer_state(path, other, torch.optim.AdamW(other.parameters()), state["optimizer"])


def test_state_is_never_unpickled(tmp_path):
    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 1, model, {"step": 1}, {})
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "payload": _Evil(str(marker))}, os.path.join(path, "state-rank00000.pt"))
    _resize_meta(path)
    with pytest.raises(ckpt.CheckpointError, match="state-rank00000.pt: refused"):
        ckpt.load_rank_state(path)
    assert not marker.exists()


def test_wrong_shape_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 1, model, {"step": 1}, {})
    fname = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors = load_file(os.path.join(path, fname))
    tensors["output_layer.weight"] = tensors["output_layer.weight"][:-1].contiguous()
    save_file(tensors, os.path.join(path, fname))
    _resize_meta(path)
    with pytest.raises(ckpt.CheckpointError, match="output_layer.weight"):
        ckpt.load_model_weights(path, model)


def test_inspect_tool_summarises_and_names_bad_files(tmp_path, capsys):
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", os.path.join(root, "tools", "inspect_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    model = build(0)
    path = ckpt.save_checkpoint(str(tmp_path), 3, model, {"step": 3}, {"mode": "pretrain"})
    s = tool.summarise(str(tmp_path))
    assert s["step"] == 3 and s["num_experts"] == 8
    assert s["num_params"] == sum(t.numel() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    assert tool.main([str(tmp_path)]) == 0
    assert "step 3" in capsys.readouterr().out

    fname = next(f for f in os.listdir(path) if f.endswith(".safetensors"))
    with open(os.path.join(path, fname), "r+b") as f:
        f.write(b"\xff" * 16)  # corrupt the header
    assert tool.main([path]) == 1
    assert fname in capsys.readouterr().err


# Saves at scale: every rank writes its share, a tensor at a time --------------------------


DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn]


def _random(dtype, shape, g):
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("checksums", [True, False])
def test_streamed_safetensors_file_reads_back_as_written(tmp_path, checksums):
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(3)
    shapes = [(), (0,), (5,), (3, 7), (2, 0, 4), (4, 3, 5)]
    tensors = {f"t{i}.{str(d)[6:]}": _random(d, shapes[(i + j) % len(shapes)], g)
               for j, d in enumerate(DTYPES) for i in range(2)}
    path = str(tmp_path / "x.safetensors")
    w = ckpt.SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], checksums=checksums)
    for n, t in tensors.items():
        w.add(n, t)
    size = w.close()
    assert size == os.path.getsize(path)
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for n, t in tensors.items():
        assert back[n].dtype == t.dtype and back[n].shape == t.shape, n
        assert torch.equal(back[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    assert meta == ({n: ckpt._crc32(t) for n, t in tensors.items()} if checksums else {})


def test_streamed_safetensors_refuses_what_its_header_does_not_say(tmp_path):
    specs = [("a", torch.float32, (2, 3)), ("b", torch.bfloat16, (4,))]
    w = ckpt.SafetensorsWriter(str(tmp_path / "x.safetensors"), specs)
    with pytest.raises(ValueError, match="tensor b given where the header has a next"):
        w.add("b", torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"tensor a is torch.float32 \(3, 2\), the header says torch.float32 \(2, 3\)"):
        w.add("a", torch.zeros(3, 2))
    w.add("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1 tensor\\(s\\) of the header never written, the first b"):
        w.close()
    w.abort()
    with pytest.raises(ValueError, match="complex64, which safetensors cannot hold"):
        ckpt.SafetensorsWriter(str(tmp_path / "y.safetensors"), [("c", torch.complex64, (1,))])


def test_joined_files_hold_every_tensor_once(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(4)
    a = {"z": torch.randn(3, generator=g), "m": torch.randn(2, 2, generator=g).bfloat16()}
    b = {"a": torch.arange(5)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    size = ckpt.join_safetensors([str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")],
                                 str(tmp_path / "j.safetensors"))
    assert size == os.path.getsize(tmp_path / "j.safetensors")
    back = load_file(str(tmp_path / "j.safetensors"))
    assert list(back) == ["a", "m", "z"] and all(torch.equal(back[k], {**a, **b}[k]) for k in back)
    save_file({"m": torch.zeros(1)}, str(tmp_path / "c.safetensors"))
    with pytest.raises(ValueError, match="c.safetensors: tensor m is in another of the files too"):
        ckpt.join_safetensors([str(tmp_path / "a.safetensors"), str(tmp_path / "c.safetensors")],
                              str(tmp_path / "k.safetensors"))


def test_a_save_holds_one_tensor_in_host_memory_at_a_time(tmp_path, monkeypatch):
    """Every host copy is gone before the next is made: a rank's share of a large model is
    written as it is copied, never gathered whole in host memory."""
    import weakref

    model = build(0)
    made, most = [], [0]
    copy = ckpt._host_copy

    def counted(t):
        most[0] = max(most[0], sum(r() is not None for r in made))
        out = copy(t)
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(ckpt, "_host_copy", counted)
    path = ckpt.save_checkpoint(str(tmp_path), 1, model, {"step": 1}, {})
    assert len(made) > 50 and most[0] == 0, (len(made), most[0])
    monkeypatch.undo()
    other = build(1)
    ckpt.load_model_weights(path, other)
    for (n, x), (_, y) in zip(model.state_dict().items(), other.state_dict().items()):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), n


def _spread_save_worker(rank, world, src, out):
    """Loads the one-process checkpoint under EP=2 x expert-dp 2, replicated and FSDP2-sharded,
    and saves each from the four ranks."""
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.parallel.fsdp import apply_fsdp

    init_megatron(rank, world, ep=2)
    paths, read = {}, {}
    for fsdp in (False, True):
        config = tiny_config(**{"parallel.world_size": world, "parallel.expert_model_parallel_size": 2,
                                "parallel.fsdp": fsdp, "model.num_layers": 4, "moe.dispatcher": "alltoall"})
        torch.manual_seed(100 + rank)  # other weights on every rank: the checkpoint brings them
        model = build_model(config)
        if fsdp:
            apply_fsdp(model, config)
        read[fsdp] = _counting_reads(lambda: ckpt.load_model_weights(src, model))
        optimizer = torch.optim.AdamW(model.parameters())  # the one-process moments, resharded
        state = ckpt.load_rank_state(src)
        ckpt.load_optimizer_state(src, model, optimizer, state["optimizer"])
        assert state["resharded_from"] == "world size 1 and expert parallel 1"
        gathered_whole = []  # under FSDP2 no rank gathers a tensor whole: each goes to its writer alone
        full_tensor = torch.distributed.tensor.DTensor.full_tensor
        torch.distributed.tensor.DTensor.full_tensor = lambda t, *a, **k: gathered_whole.append(t.shape) or full_tensor(
            t, *a, **k)
        try:
            paths[fsdp] = ckpt.save_checkpoint(os.path.join(out, str(fsdp)), 2, model, {"step": 2}, {},
                                               optimizer=optimizer)
        finally:
            torch.distributed.tensor.DTensor.full_tensor = full_tensor
        assert not gathered_whole, gathered_whole[:3]
    # a corrupt dense tensor: under FSDP2 one rank checks its checksum, and every rank raises
    bad = os.path.join(out, "bad")
    if rank == 0:
        import shutil

        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        shutil.copytree(src, bad)
        fname = "model-ep00000-r00000.safetensors"
        with safe_open(os.path.join(bad, fname), framework="pt") as h:
            crcs = h.metadata()
        tensors = load_file(os.path.join(bad, fname))
        tensors["output_layer.weight"][1, 2] += 1.0
        save_file(tensors, os.path.join(bad, fname), metadata=crcs)
        _resize_meta(bad)
    torch.distributed.barrier()
    try:
        ckpt.load_model_weights(bad, model)
        raised = None
    except ckpt.CheckpointError as e:
        raised = str(e)
    return paths, read, raised


def _counting_reads(fn) -> int:
    """Bytes of tensor data fn read through the checkpoint module (the checkpoint benchmark's counter)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("checkpoint_at_scale", os.path.join(root, "benchmarks",
                                                                                      "checkpoint_at_scale.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench._counting_reads(ckpt, fn)


def _stepped_adam(model) -> torch.optim.AdamW:
    """AdamW over model after one step on random gradients: moments that differ per element."""
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


@pytest.mark.distributed
def test_four_ranks_write_a_quarter_each_and_the_checkpoint_equals_one_process(tmp_path):
    """EP=2 x expert-dp 2, replicated and FSDP2: each rank writes its file (dense tensors to the
    rank with the fewest bytes, replicated experts in turns, FSDP2's expert shards by their
    holders), no tensor twice, and the tensors equal the one-process checkpoint's bitwise; a load
    under FSDP2 reads about a quarter of the checkpoint on each rank. The optimizer's moments
    reshard the same way, from one process to the four ranks and back."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from megatron_moe_hybrid.testing import spawn

    model = build(0)
    optimizer = _stepped_adam(model)
    src = ckpt.save_checkpoint(str(tmp_path / "one"), 1, model, {"step": 1}, {}, optimizer=optimizer)
    whole = load_file(os.path.join(src, "model-ep00000-r00000.safetensors"))
    moments = load_file(os.path.join(src, "optim-ep00000-r00000.safetensors"))
    assert len(moments) == 2 * len(whole)  # AdamW's two moments of each tensor
    biggest = max(t.numel() * t.element_size() for t in whole.values())
    results = spawn(_spread_save_worker, 4, src, str(tmp_path / "four"))
    nbytes = {k: t.numel() * t.element_size() for k, t in whole.items()}
    total, experts = sum(nbytes.values()), sum(v for k, v in nbytes.items() if ".expert" in k)
    # the loads: replicated, each rank reads its EP rank's experts (half) and every dense tensor;
    # under FSDP2 its shard's experts (a quarter), its rows of the dense ones, and whole the dense
    # ones whose checksum it checks (a quarter of them, up to one tensor)
    assert [r[1][False] for r in results] == [experts // 2 + total - experts] * 4
    for r in results:
        assert r[1][True] <= experts / 4 + 2 * (total - experts) / 4 + biggest, (r[1][True], total, experts)
        assert "tensor output_layer.weight is corrupt (checksum mismatch)" in r[2], r[2]
    for fsdp, path in results[0][0].items():
        # the moments, loaded under EP2 x expert-dp 2 and saved again, are the one-process ones
        # bitwise, each written once; loaded back in one process, the optimizer's state
        files = sorted(f for f in os.listdir(path) if f.startswith(ckpt.OPTIMIZER_PREFIX))
        seen, by_rank = {}, {}
        for f in files:
            part = load_file(os.path.join(path, f))
            assert not part.keys() & seen.keys()
            seen.update(part)
        for f in os.listdir(path):  # weights and moments together spread over the ranks
            if f.endswith(".safetensors"):
                rank = f.rpartition("-r")[2]
                by_rank[rank] = by_rank.get(rank, 0) + os.path.getsize(os.path.join(path, f))
        assert max(by_rank.values()) <= sum(by_rank.values()) / 4 + biggest, (fsdp, by_rank, biggest)
        assert seen.keys() == moments.keys() and all(torch.equal(seen[k], moments[k]) for k in moments), fsdp
        again_model = build(1)
        again = torch.optim.AdamW(again_model.parameters())
        ckpt.load_optimizer_state(path, again_model, again, ckpt.load_rank_state(path)["optimizer"])
        for p, q in zip(model.parameters(), again_model.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizer.state[p][key], again.state[q][key]), (fsdp, key)
        files = sorted(f for f in os.listdir(path) if f.startswith("model-"))
        assert sorted(f.rpartition("-r")[2] for f in files) == [f"{r:05d}.safetensors" for r in range(4)], files
        seen: dict = {}
        sizes = {}
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as h:
                keys = list(h.keys())
            assert not set(keys) & set(seen), (fsdp, sorted(set(keys) & set(seen))[:3])
            seen.update(dict.fromkeys(keys, f))
            sizes[f] = sum(whole[k].numel() * whole[k].element_size() for k in keys)
            for k, t in load_file(os.path.join(path, f)).items():
                assert torch.equal(t, whole[k]), (fsdp, k)
        assert seen.keys() == whole.keys(), fsdp
        assert max(sizes.values()) <= sum(sizes.values()) / 4 + biggest, (fsdp, sizes, biggest)
        other = build(1)
        ckpt.load_model_weights(path, other)
        for (n, x), (_, y) in zip(model.state_dict().items(), other.state_dict().items()):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), (fsdp, n)


def _gpu_fsdp_worker(rank, world, src, out):
    """The one-process checkpoint loaded into an FSDP2 model on the GPU (a mesh of one rank: every
    tensor a DTensor sharded along dim 0, read by rows), then saved from it."""
    from megatron_moe_hybrid.models import build_model
    from megatron_moe_hybrid.parallel.fsdp import apply_fsdp

    init_megatron(rank, world)
    config = tiny_config(**{"parallel.fsdp": True, "model.num_layers": 4})
    torch.manual_seed(7)
    model = build_model(config).cuda()
    apply_fsdp(model, config)
    assert all(isinstance(t, torch.distributed.tensor.DTensor) for t in model.parameters())
    ckpt.load_model_weights(src, model)
    return ckpt.save_checkpoint(out, 2, model, {"step": 2}, {})


@pytest.mark.gpu
def test_an_fsdp_checkpoint_on_the_gpu_equals_the_cpu_one(tmp_path):
    from megatron_moe_hybrid.testing import spawn

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    src = ckpt.save_checkpoint(str(tmp_path / "cpu"), 1, build(0), {"step": 1}, {})
    (path,) = spawn(_gpu_fsdp_worker, 1, src, str(tmp_path / "gpu"), backend="nccl")

    want, got = checkpoint_tensors(src), checkpoint_tensors(path)
    assert want.keys() == got.keys() and any(".expert7" in k for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
