"""SparDA Forecast heads: the heads and their targets, training, and the selector report."""
