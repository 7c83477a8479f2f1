"""Watcher: polls every edge for health and load; no durable state."""

from dsec.watcher.watcher import EdgeLike, Watcher

__all__ = ["EdgeLike", "Watcher"]
