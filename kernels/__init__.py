"""Triton kernels for sparse prefill, offloaded decode and exact attention statistics (`attn_stats`), each
with a PyTorch reference (`*_ref`); imported as `workbench_kernels`. A leaf: it imports only torch, triton
and its own modules (the Triton ones on import of their module, not of the package).

`BLOCK` is the tile edge in tokens every kernel and the library share (64 query rows x 64 keys);
`NO_WINDOW` the sliding-window size the prefill kernel reads as "no window" (heads without a band mask).
"""
BLOCK = 64
NO_WINDOW = 1 << 30
