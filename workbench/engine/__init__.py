"""Offloaded sparse decode: pinned host block store, GPU block cache, forecast prefetch, decode loop."""
from .cache import BlockCache, CopyPlan
from .decoder import MODES, DecodeEngine, DecodeStats, EngineConfig
from .store import BlockStore, StoreCapacityError, StoreSpec

__all__ = ["BlockCache", "CopyPlan", "MODES", "DecodeEngine", "DecodeStats", "EngineConfig", "BlockStore",
           "StoreCapacityError", "StoreSpec"]
