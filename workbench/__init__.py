"""Sparse Attention Workbench: see, fit, measure, forecast and time sparse attention in LLMs."""
__version__ = "0.1.0"
