"""``python -m aiserve_trio.audit SPEC``: the audit writer's process (``child.py``)."""

import sys

from .child import main

main(sys.argv)
