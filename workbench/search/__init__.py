"""Per-head pattern search: evidence over the pattern registry, the choice, and the distributed search.
The head config it writes lives in `workbench.config`."""
