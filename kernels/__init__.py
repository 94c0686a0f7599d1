"""Triton kernels for sparse prefill and offloaded decode, with PyTorch references; imported as
`workbench_kernels`. A leaf: it imports only torch, triton and its own modules.

`BLOCK` is the tile edge in tokens every kernel and the library share (64 query rows x 64 keys);
`NO_WINDOW` the sliding-window size the prefill kernel reads as "no window" (heads without a band mask).
"""
BLOCK = 64
NO_WINDOW = 1 << 30
