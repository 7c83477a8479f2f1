"""Processes' CPU from /proc/PID/stat, for the benchmark scripts (each runs with benchmarks/ on
sys.path: `python benchmarks/X.py`, or PYTHONPATH=...:benchmarks for the *_ab drivers).

The reader itself is dsec.procstat (the drivers, benches and tests use it too); this module
keeps the scripts' `from procstat import ...`."""

from __future__ import annotations

from dsec.procstat import TCK, cpu_ns, cpu_s, cpu_ticks, fields, processes

__all__ = ["TCK", "cpu_ns", "cpu_s", "cpu_ticks", "fields", "processes"]
