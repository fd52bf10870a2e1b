"""Virtual keys, teams and tenants in the audit database, and the admin audit trail
(issue 47, items 1, 2, 3 and 5).

- ``schema``: the tables and their migrations (a version track of their own beside the
  audit log's ``audit_schema``);
- ``records``: what a key and a team carry, and the rule that a key only narrows its
  team's and tenant's grant (pure);
- ``table``: the worker's in-memory key table the gate checks (pure: no database on the
  request path);
- ``db``: the blocking database calls (SQLite or PostgreSQL), run in a thread;
- ``service``: the worker's copy of the table, refreshed from the database, the
  batched last-use writes, the outage state; and the admin actions;
- ``http``: ``/admin/keys``, ``/admin/teams`` and ``/admin/audit``.
"""
