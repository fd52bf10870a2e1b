"""MCP servers the MCP gateway's tests run (tests/test_mcp*.py)."""
