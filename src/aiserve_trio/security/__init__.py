"""Access control and edge protection: API keys and tenants, stream tokens, rate
limits, admission control, and guards around hypercorn's connection handling.

Submodules are imported where they are used (this package imports nothing at
start), so that ``stages`` and ``config`` can use small parts without cycles.
"""
