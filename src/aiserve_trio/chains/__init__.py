"""Capability chains: a route as named steps (speech to text, intent, generation, rewrite).

- ``steps.py``: the ``[[routes.steps]]`` tables (msgspec Structs; the config imports them);
- ``plan.py``: pure -- the checks between a chain's steps, the plan (enabled steps,
  their budget shares, which step streams), the cut points, rule and route matching;
- ``run.py``: the executor the inference stage runs a chain with (adapters, spans).

This package's ``__init__`` imports nothing, so that the config can import
``steps`` and ``plan`` without the executor's imports.
"""
