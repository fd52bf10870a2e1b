"""The response cache: exact match on everything that changes the answer, single flight.

- ``key.py``: the key (pure): what changes the answer, canonical JSON, hashed;
- ``entry.py``: what is stored: the reply's released pieces (post-policy);
- ``lru.py``: the memory backend's LRU by bytes (pure);
- ``flight.py``: single flight's state: the shared log, the table of flights (no I/O);
- ``backend.py``, ``redis.py``: where entries live, and (Redis) leases and
  published answers across gateways;
- ``facts.py``, ``semantic.py``: the semantic tier: a question's facts (pure), the
  embedder call, the vector index;
- ``remote.py``: across gateways: bounded backend calls, single flight through a
  shared backend, the semantic index's shared log;
- ``service.py``: what the stages call: admit, replay / follow, release.
"""
