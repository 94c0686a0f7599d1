"""The tile geometry every kernel and the library share.

`BLOCK` is the tile edge in tokens (64 query rows x 64 keys); `NO_WINDOW` the sliding-window size the
prefill kernel reads as "no window" (heads without a band mask).
"""
BLOCK = 64
NO_WINDOW = 1 << 30
