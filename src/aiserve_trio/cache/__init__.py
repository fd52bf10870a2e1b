"""The response cache: exact match on everything that changes the answer.

- ``key.py``: the key (pure): what changes the answer, canonical JSON, hashed.
"""
