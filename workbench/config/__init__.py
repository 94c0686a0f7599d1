"""Head configs: the per-(layer, head) pattern choice as a versioned JSON file, and its other views
(MInference's per-layer format, one tensor-parallel rank's heads). Below `search` in the data flow:
prefill, engine and views read configs without importing the search."""
from workbench.config.head_config import (
    FORMAT,
    MINFERENCE_DEFAULT,
    PARAMS,
    PROXY_DEFAULTS,
    SCHEMA,
    ConfigError,
    HeadConfig,
    HeadEntry,
    check_schema,
    global_head,
    local_head,
    model_heads,
    rank_kv_heads,
    tp_split,
)

__all__ = ["FORMAT", "MINFERENCE_DEFAULT", "PARAMS", "PROXY_DEFAULTS", "SCHEMA", "ConfigError", "HeadConfig", "HeadEntry",
           "check_schema", "global_head", "local_head", "model_heads", "rank_kv_heads", "tp_split"]
