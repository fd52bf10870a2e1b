"""The audit log: one row per request (schema, rows, the writer, the databases, usage reads)."""
