"""The running gateway: one config's generation, its assembly and its reloads, start-up
checks, telemetry, and the ASGI shell with the per-request entry.
"""
