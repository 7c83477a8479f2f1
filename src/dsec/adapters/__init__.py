"""Adapters: other frameworks' sandbox interfaces, served by dsec sandboxes.

Each adapter is one module that imports its framework (an optional dependency) and, of dsec,
only the client SDK (`dsec.sdk`, `dsec.types`): it runs wherever the SDK runs, talks to any
dsec over HTTP, and nothing in dsec imports it.

- `dsec.adapters.swerex`: a SWE-ReX deployment + runtime (so SWE-agent) on dsec containers
  (`pip install 'dsec-sandbox[swerex]'`; docs/adapters.md).
"""
