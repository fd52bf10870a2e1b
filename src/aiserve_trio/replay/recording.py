"""Reading recordings: files of JSON lines (``record/schema.py``), or directories of them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ..record.schema import Record, decoder


@dataclass(slots=True)
class Recording:
    """The replayable records, oldest first, and what was left out."""

    records: list[Record] = field(default_factory=list)
    #: Lines without a body (the request never got past its policies) or not a record.
    no_body: int = 0
    malformed: int = 0

    def times(self) -> list[float]:
        """Each record's arrival, Unix seconds."""
        return [r.at for r in self.records]

    def labels(self) -> list[dict[str, str]]:
        return [r.labels for r in self.records]


def parse_lines(lines: Iterable[bytes]) -> Recording:
    """The records of recorded lines (pure), sorted by arrival."""
    out = Recording()
    for line in lines:
        if not line.strip():
            continue
        try:
            record = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            out.malformed += 1
            continue
        if not record.has_body:
            out.no_body += 1
            continue
        out.records.append(record)
    # Several files (rotation, workers) merge on one time line.
    out.records.sort(key=lambda r: r.at)
    return out


def recording_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files named, and the ``*.jsonl`` files of the directories named (sorted).

    Raises:
        FileNotFoundError: a path does not exist.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.glob("*.jsonl")))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return files


def read_recording(paths: Sequence[str | Path]) -> Recording:
    """Every record of the files and directories named.

    Raises:
        FileNotFoundError: a path does not exist.
        OSError: a file cannot be read.
    """
    def lines() -> Iterable[bytes]:
        for f in recording_files(paths):
            with f.open("rb") as fh:
                yield from fh

    return parse_lines(lines())
