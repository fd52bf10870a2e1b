"""``python -m aiserve_trio.replay``: the same as ``aiserve-replay``."""

from .cli import main

raise SystemExit(main())
