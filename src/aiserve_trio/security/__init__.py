"""Access control and edge protection: API keys and tenants, stream tokens, rate
limits, admission control, and the edge guard's rules (pure: ``server/`` applies them
to hypercorn's connections).

Submodules are imported where they are used (this package imports nothing at
start), so that ``stages`` and ``config`` can use small parts without cycles.
"""
