"""Exact attention statistics (blockwise, never n x n per head), captured-mass metrics and oracles, head
kinds, and block-set overlap (IoU, churn) across layers and steps."""
