"""The host launch arithmetic (ops/_intmath.py) gives what Triton's host-callable helpers give."""

import random

import pytest

from megatron_moe_hybrid.ops._intmath import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


def test_cdiv_and_next_power_of_2_equal_tritons():
    rng = random.Random(0)
    ns = list(range(0, 2100)) + [2**k + d for k in range(11, 63) for d in (-1, 0, 1)]
    ns += [rng.randrange(1, 2**40) for _ in range(2000)]
    for n in ns:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 127, 128, rng.randrange(1, 10**6)):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
