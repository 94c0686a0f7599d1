"""Sparse prefill of a whole model from a head config, its quality report vs dense, whether the config holds at other
lengths, and its latency model."""
