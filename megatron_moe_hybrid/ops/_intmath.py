"""Launch arithmetic on the host: `cdiv` and `next_power_of_2` as plain Python.

In Triton 3.6 (the GPU machine's) and 3.9 (this one's) `triton.cdiv` and `triton.next_power_of_2`
are `ConstexprFunction` wrappers, so that kernels may call them: called from host code each
does an import and unwraps its arguments, about 1.6 us against 0.03 us for the arithmetic
itself (measured on the CPU machine, Triton 3.9). The ops size their grids and blocks with
them dozens of times per layer and step (36 calls in one Gated DeltaNet forward+backward when
measured), so host code uses these; kernels keep `tl.cdiv`. The arithmetic is Triton's own
(tests/ops/test_intmath.py compares the two on small, power-of-two and random ints).
"""


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for y > 0, as triton.cdiv."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for 1 <= n <= 2^64 (0 for 0), as triton.next_power_of_2."""
    n -= 1
    n |= n >> 1
    n |= n >> 2
    n |= n >> 4
    n |= n >> 8
    n |= n >> 16
    n |= n >> 32
    return n + 1
