"""A small MCP server written with the official ``mcp`` SDK, for the gateway's fault tests.

Run over stdio (``python -m tests.mcp_servers.faulty``), or over Streamable HTTP
(``python -m tests.mcp_servers.faulty http PORT``). Its tools:

- ``echo``: the arguments as it received them (JSON), so a test sees what reached it;
- ``hang``: never answers; it records the cancellation the gateway sends upstream;
- ``cancelled``: how many calls were cancelled so far;
- ``crash``: the process exits mid-call;
- ``garbage``: writes a line that is not JSON-RPC to stdout, then answers;
- ``big``: a text of ``n`` characters;
- ``many``: ``n`` small objects;
- ``whoami``: the ``Authorization`` header the call came with (over HTTP);
- ``pid``: its process id.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
from mcp.server.mcpserver import Context, MCPServer

app = MCPServer("faulty")
#: The protocol's pipe, kept before the SDK points fd 1 elsewhere (it guards its wire).
_WIRE = os.dup(1)
_cancelled = [0]


@app.tool()
def echo(text: str = "", card: str = "") -> str:
    """Answer with the arguments as received."""
    return json.dumps({"text": text, "card": card})


@app.tool()
async def hang() -> str:
    """Never answers (until cancelled)."""
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        _cancelled[0] += 1
        raise
    return "unreachable"


@app.tool()
def cancelled() -> str:
    """How many calls were cancelled."""
    return str(_cancelled[0])


@app.tool()
def crash() -> str:
    """Exit the process mid-call."""
    os._exit(3)


@app.tool()
def garbage() -> str:
    """Write something that is not JSON-RPC on stdout."""
    os.write(_WIRE, b"this is not json\n")
    return "after garbage"


@app.tool()
def big(n: int) -> str:
    """A text of ``n`` characters."""
    return "x" * n


@app.tool()
def many(n: int) -> list[dict[str, object]]:
    """``n`` small objects (a big answer of many items: structured content and its text)."""
    return [{"i": i, "s": "abc"} for i in range(n)]


@app.tool()
def whoami(ctx: Context) -> str:
    """The Authorization header this call came with (over HTTP; "" over stdio)."""
    headers = ctx.headers or {}
    return str(headers.get("authorization", ""))


@app.tool()
def pid() -> str:
    """The server's process id (a restart changes it)."""
    return str(os.getpid())


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
