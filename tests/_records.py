"""Hand-edited vault records for tests: reseal what a test changes on purpose, so the
record's own checksum passes and the check under test (a field, a header) is reached."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from weightvault._vault.records.record import encode_record
from weightvault._vault.store.seal import seal as seal_body

_SUM = re.compile(r',\s*"sum"\s*:\s*"[0-9a-f]{32}"')


def seal(text: str) -> str:
    """``text`` (a record's JSON, edited as text) with its checksum made anew."""
    return seal_body(_SUM.sub("", text).rstrip().encode()).decode()


def rewrite(path: Path, doc: dict[str, Any]) -> None:
    """Write record ``doc`` to ``path``, sealed as the vault seals it."""
    path.write_bytes(encode_record(doc))


def read(path: Path) -> dict[str, Any]:
    """A record's JSON without its checksum field."""
    doc: dict[str, Any] = json.loads(path.read_text())
    doc.pop("sum", None)
    return doc
