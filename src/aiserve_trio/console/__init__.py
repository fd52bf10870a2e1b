"""The operator console: ``/admin/``, a small web page for admin keys, and its API.

- ``static/``: the page (``index.html``, ``console.js``, ``console.css``), plain ES
  modules and HTML5 drag and drop, shipped as package data: no build step, no CDN.
- :mod:`.handlers`: the endpoints (``GET /admin/``, ``/admin/static/{name}``, and
  ``/admin/api/*``: login, overview, slow requests, routes and their steps).
- :mod:`.sla`: the SLA and stage tables from the gateway's own metrics (pure).
- :mod:`.edit`: a route's steps reordered and switched on or off in the config
  file's text, comments kept (pure).
"""
