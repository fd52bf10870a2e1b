"""The MCP gateway: ``/mcp`` in front of the upstream MCP servers ``[mcp.servers.NAME]``
names (issue 52).

- :mod:`.settings`: the ``[mcp]`` tables (config.py only assembles them).
- :mod:`.jsonrpc`: JSON-RPC 2.0 messages in and out, sans-IO (msgspec).
- :mod:`.grants`: which tools a key (and its tenant) may see and call, sans-IO.
- :mod:`.upstream`: the clients of the upstream servers (stdio child, Streamable HTTP).
- :mod:`.hub`: the worker's upstreams, their state, their metrics (long-lived).
- :mod:`.endpoint`: the ``/mcp`` handler of one runtime (its config's grants and
  policies), sessions, deadlines, redaction, audit rows.
"""
