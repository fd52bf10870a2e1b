"""MkDocs hooks (mkdocs.yml ``hooks:``): the generated reference pages.

``reference/config.md`` is written from the config schema, ``reference/metrics.md``
from the metrics the code registers and ``reference/errors.md`` from its error classes
and the codes raised, at every build (tools/*_reference.py); none is a file in docs/.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mkdocs.structure.files import File, Files  # noqa: E402

from tools import config_reference, errors_reference, metrics_reference  # noqa: E402

GENERATED = {
    "reference/config.md": config_reference.render,
    "reference/metrics.md": metrics_reference.render,
    "reference/errors.md": errors_reference.render,
}


def on_files(files: Files, config: Any, **_: Any) -> Files:
    for uri, render in GENERATED.items():
        files.append(File.generated(config, uri, content=render()))
    return files
