"""Order-preserving integer keys of fp32 scores, for Triton top-k by bisection on integers
(`index_build._block_topk_kernel`, `block_select._pool_topk_kernel`)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def order_key(x):
    """Int32 keys whose signed order is the order of the fp32 values x (their bits, negatives' magnitude bits
    flipped; -inf lowest, +inf highest)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)
