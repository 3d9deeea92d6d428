"""What Triton compiled for one linear-attention call, kernel by kernel, on the GPU.

    python benchmarks/device/kernel_asm.py --op gla --shape h32 [--dump DIR]

Runs one forward+backward at the shape (shape keys: linear_attention.SHAPES), then prints for
every compiled variant of triton_chunk's kernels its launch options, shared memory, registers
and spills per thread, and, from its TTGIR, how many stores and loads there are and from which
layouts, how many layout conversions and shared-memory buffers: enough to tell whether a store
goes out of the dot's accumulator layout or through shared memory. --dump writes each TTGIR and
PTX there.
"""

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import linear_attention as bench  # noqa: E402

def ttgir_summary(ttgir: str) -> dict:
    """Counts of the operations that show how data moves, by the layout they take."""
    out = collections.Counter()
    for line in ttgir.splitlines():
        for op in ("tt.store", "tt.load", "ttg.convert_layout", "ttg.local_alloc", "ttg.async_copy_global_to_local",
                   "ttng.warp_group_dot", "tt.dot", "ttng.async_tma_copy_local_to_global"):
            if f"{op} " in line:
                layout = re.findall(r"#(mma|blocked\d*|linear\d*|shared\d*|dot_op)", line)
                out[f"{op} [{layout[-1] if layout else '?'}]"] += 1
    return dict(sorted(out.items()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="gla")
    p.add_argument("--shape", default="h32")
    p.add_argument("--dump", default=None)
    a = p.parse_args()
    _, x, cu, do = bench.case(a.op, a.shape)
    fn = bench.ours_fn(a.op, cu)
    torch.autograd.grad(fn(x), list(x.values()), do)
    torch.cuda.synchronize()
    for name, kern in bench.fast_kernels().items():
        for i, (compiled, tail) in enumerate(kern.cache.values()):  # the keyword arguments launched with
            consts = {n: v for n, v in zip(kern.names[len(kern.names) - len(tail):], tail)
                      if isinstance(v, (bool, int)) and (v is not False)}
            print(f"== {name} #{i}: {bench.resources(compiled)}; {consts}", flush=True)
            for k, v in ttgir_summary(compiled.asm["ttgir"]).items():
                print(f"     {v:4d}  {k}", flush=True)
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(a.dump, f"{name}_{i}.{ext}"), "w") as f:
                        f.write(compiled.asm[ext])


if __name__ == "__main__":
    main()
