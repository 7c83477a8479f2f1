"""Helpers for tests and benchmarks: isolated servers on a throw-away DSEC_HOME, and the fake
backend and agent stub for the edge's unit tests (no root, no crun)."""
