"""``aiserve-replay``: recorded traffic (``aiserve_trio.record``) sent again, weighted by class.

The pure cores -- the schedule (``schedule.py``), the weighted draw
(``weights.py``), measuring a response (``timing.py``), the report and the gate
(``stats.py``) -- have no I/O; ``runner.py`` runs a schedule on Trio against any
``send``, ``client.py`` is that ``send`` over HTTP (httpx2), ``cli.py`` the
command line.
"""
