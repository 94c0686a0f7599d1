"""Offloaded sparse decode: the engine (host store, GPU block cache, selection), Forecast heads and timelines."""
