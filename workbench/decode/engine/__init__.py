"""Offloaded sparse decode: pinned host block store, GPU block cache, forecast prefetch, decode loop."""
from workbench.decode.engine.cache import BlockCache, CopyPlan
from workbench.decode.engine.decoder import MODES, DecodeEngine, DecodeStats, EngineConfig
from workbench.decode.engine.store import BlockStore, StoreCapacityError, StoreSpec

__all__ = ["BlockCache", "CopyPlan", "MODES", "DecodeEngine", "DecodeStats", "EngineConfig", "BlockStore",
           "StoreCapacityError", "StoreSpec"]
