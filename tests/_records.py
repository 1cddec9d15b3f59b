"""Hand-edited vault records for tests: reseal what a test changes on purpose, so the
record's own checksum passes and the check under test (a field, a header) is reached."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from weightvault._vault.records import encode_record

_SUM = re.compile(r',\s*"sum"\s*:\s*"[0-9a-f]{32}"')


def seal(text: str) -> str:
    """``text`` (a record's JSON, edited as text) with its checksum made anew."""
    body = _SUM.sub("", text).rstrip()
    import xxhash

    digest = xxhash.xxh3_128_hexdigest(body.encode())
    return f'{body[:-1]},"sum":"{digest}"}}'


def rewrite(path: Path, doc: dict[str, Any]) -> None:
    """Write record ``doc`` to ``path``, sealed as the vault seals it."""
    path.write_bytes(encode_record(doc))


def read(path: Path) -> dict[str, Any]:
    """A record's JSON without its checksum field."""
    doc: dict[str, Any] = json.loads(path.read_text())
    doc.pop("sum", None)
    return doc
