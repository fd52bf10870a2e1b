"""``python -m aiserve_trio.util.wavtool``: WAVs that carry their transcript, from a shell.

::

    python -m aiserve_trio.util.wavtool make "I want to pay my card in instalments" ask.wav
    python -m aiserve_trio.util.wavtool chat ask.wav --model aiserve-mock --stream > body.json

``make`` writes a WAV (silence with the text as its ``LIST``/``INFO`` comment,
which the mock model and aiserve-sim hear as its transcript: ``util/wav.py``);
``chat`` prints a Chat Completions request whose user message is the file as an
``input_audio`` part, ready for ``curl -d @-``. A module of its own, so that
``python -m`` does not run one the package has already imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .wav import FORMATS, audio_part, make_wav


def main(argv: Sequence[str] | None = None) -> int:
    """Make a WAV, or print a chat request carrying one."""
    summary = (__doc__ or "").split("\n")[0]
    p = argparse.ArgumentParser(prog="python -m aiserve_trio.util.wavtool", description=summary)
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a WAV whose transcript is TEXT")
    make.add_argument("text")
    make.add_argument("file", help="where to write it ('-': standard output)")
    make.add_argument("--seconds", type=float, default=1.0)
    chat = sub.add_parser("chat", help="print a chat completions request with FILE as audio")
    chat.add_argument("file")
    chat.add_argument("--model", default=None, help="the request's `model` (default: none)")
    chat.add_argument("--stream", action="store_true")
    ns = p.parse_args(argv)
    if ns.command == "make":
        audio = make_wav(ns.text, ns.seconds)
        if ns.file == "-":
            sys.stdout.buffer.write(audio)
        else:
            Path(ns.file).write_bytes(audio)
        return 0
    path = Path(ns.file)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        p.error(f"{path}: the file must end in .wav or .mp3")
    body: dict[str, object] = {
        "messages": [{"role": "user", "content": [audio_part(path.read_bytes(), fmt)]}]
    }
    if ns.model:
        body["model"] = ns.model
    if ns.stream:
        body["stream"] = True
    print(json.dumps(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
