"""Argument checks the ops share: a scalar's kind, and whether a host read is allowed now.

Each op words its own ValueError (naming its argument as its module does); these say only
whether the value passes.
"""

import math
import numbers

import torch


def positive_finite(x) -> bool:
    """x is a real number (not a bool), finite and > 0: a softmax or output scale."""
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x) and x > 0


def capturing(x: torch.Tensor) -> bool:
    """x's stream is capturing a CUDA graph, which refuses host reads: an op skips its data checks
    there (the eager calls that warm a graph up before its capture made them)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
