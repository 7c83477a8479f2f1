"""Placement: pick a node for a new sandbox (power of k choices over the watcher's view)."""

from dsec.placement.placer import Placer

__all__ = ["Placer"]
