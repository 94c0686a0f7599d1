"""The model and what is read from it: load_model, prompts (corpus), capture of post-RoPE q/k/v, the
attention hook, atomic file writes and timing."""
