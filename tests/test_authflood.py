"""A short, bounded version of bench/authflood.py: wrong secrets on the README's ``demo``
key id from 300 loopback addresses for 3 s, against the real gateway under hypercorn.

What a user would notice is asserted: the valid client is answered (at least 90 % 200s,
none refused for want of a slot), the attackers are refused -- their connections closed
and then reset at accept -- and wrong keys of known and unknown ids are both plain 401s.
How fast is measured by the bench, not here.
"""

from __future__ import annotations

import pytest
from bench import authflood

pytestmark = pytest.mark.slow


def test_a_flood_of_wrong_secrets_leaves_a_valid_client_served() -> None:
    result = authflood.run(connections=300, seconds=3.0, probes=10)
    statuses = result["valid_statuses"]
    assert isinstance(statuses, dict)
    assert sum(statuses.values()) >= 5
    served = result["valid_served"]
    assert isinstance(served, float)
    assert served >= 0.9, statuses
    assert "503" not in statuses
    attacker = result["attacker"]
    assert isinstance(attacker, dict)
    assert attacker.get("503", 0) == 0  # a wrong key is refused as one, never as overload
    assert attacker["401"] > 0
    assert attacker["closed by server"] > 0  # boxed: its keep-alive connection ends
