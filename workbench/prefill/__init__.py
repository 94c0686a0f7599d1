"""Sparse prefill of a whole model from a head config, its quality report vs dense and its latency model."""
