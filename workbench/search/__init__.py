"""Per-head pattern search (evidence, choice), the head config it writes (schema, MInference and
tensor-parallel views) and the distributed search."""
