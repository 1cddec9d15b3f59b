"""Type aliases shared across the package."""

from __future__ import annotations

import os

#: A filesystem path, as a string or an ``os.PathLike``.
PathLike = str | os.PathLike[str]
