"""The `dsec` command line: client commands over HTTP, and operator commands (serve, build
images and VM disks, benchmarks) that import the server side lazily, only when run."""

from dsec.cli.main import main

__all__ = ["main"]
