"""The HTTP layer: ASGI types, the one writer of a response, every SSE byte, the endpoint table.

Like hypercorn's split between protocol code and loop code, nothing here knows
what a chat request is: the pipeline and the session endpoints use these
pieces to speak HTTP.
"""
