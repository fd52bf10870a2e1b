"""atheris harness for the request decoder: only documented GatewayErrors may escape.

    .venv/bin/pip install atheris
    .venv/bin/python tests/fuzz/fuzz_decode_request.py -max_total_time=300 corpus/

See README.md in this folder.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from aiserve_trio.config import LimitsConfig
    from aiserve_trio.core.errors import GatewayError
    from aiserve_trio.stages.parse import decode_request

LIMITS = LimitsConfig()
DOCUMENTED = {400, 404, 413, 415, 422}


def test_one_input(data: bytes) -> None:
    try:
        decode_request(data, LIMITS, "aiserve-mock")
    except GatewayError as err:
        if err.status not in DOCUMENTED:
            raise


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
