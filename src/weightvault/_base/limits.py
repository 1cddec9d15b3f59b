"""How many bytes a foreign-format reader may decode from one file.

Most of a foreign file is handed out as slices of a read-only file map, which cost no
memory. Some of it must be decoded into new memory: deflated ``.npz`` members are
inflated, MXNet sparse arrays are densified, strided ``.pt`` tensors are made contiguous,
chunked HDF5 datasets are read, and every name costs some bookkeeping. A crafted file can
make each of these large from a few bytes (a stride-0 tensor, a deflate bomb, an unwritten
HDF5 dataset, a dict referenced many times), so every reader charges what it is about to
decode to one :class:`DecodeBudget` per open, *before* it allocates.

The limit for a file of ``size`` bytes is, by default::

    min(DEFAULT_RATIO * size + DEFAULT_SLACK, DEFAULT_CEILING)

that is 16 bytes per file byte plus 64 MiB, and never more than 32 GiB. A caller who
trusts a file that decodes to more (a big ``row_sparse`` embedding, an ``.npz`` of zeros)
sets the limit for one open with the ``max_decoded_bytes=`` keyword of
:func:`weightvault.formats.open_any` and the readers, or for the process with the
environment variable ``WEIGHTVAULT_MAX_DECODED_BYTES`` (a byte count, read at each open,
which also reaches ``load_file``, ``convert`` and the CLI). An explicit limit replaces the
whole formula, ratio and ceiling included.

Example:
    >>> budget = DecodeBudget("m.npz", file_size=1000)
    >>> budget.limit == 16 * 1000 + (64 << 20)
    True
    >>> budget.charge("array 'w'", 10_000)
    >>> budget.used
    10000
"""

from __future__ import annotations

import os

from .errors import FormatError, InvalidLimitError

__all__ = [
    "DEFAULT_CEILING",
    "DEFAULT_RATIO",
    "DEFAULT_SLACK",
    "ENV_VAR",
    "NAME_COST",
    "DecodeBudget",
    "InvalidLimitError",
    "default_limit",
    "resolve_limit",
]

#: The environment variable that sets the limit, in bytes, for every open in the process.
ENV_VAR = "WEIGHTVAULT_MAX_DECODED_BYTES"
#: Decoded bytes allowed per byte of the file.
DEFAULT_RATIO = 16
#: Decoded bytes allowed on top of the ratio, so small files with compressed zeros work.
DEFAULT_SLACK = 64 << 20
#: No file decodes to more than this by default, however large it is.
DEFAULT_CEILING = 32 << 30
#: What one name costs (its string, its record and the plan's entry), charged per name.
NAME_COST = 256


def default_limit(file_size: int) -> int:
    """The decoded-bytes limit of a file of ``file_size`` bytes when no caller sets one."""
    return min(DEFAULT_RATIO * max(file_size, 0) + DEFAULT_SLACK, DEFAULT_CEILING)


def resolve_limit(file_size: int, max_decoded_bytes: int | None = None) -> tuple[int, str]:
    """The limit for one open, and where it came from (for messages).

    Args:
        file_size: The file's size in bytes.
        max_decoded_bytes: The caller's limit; ``None`` falls back to the environment
            variable, then to :func:`default_limit`.

    Raises:
        InvalidLimitError: The argument or the environment variable is not a
            non-negative integer.
    """
    if max_decoded_bytes is not None:
        if not isinstance(max_decoded_bytes, int) or isinstance(max_decoded_bytes, bool):
            raise InvalidLimitError(
                f"max_decoded_bytes must be an int byte count, not {max_decoded_bytes!r}"
            )
        if max_decoded_bytes < 0:
            raise InvalidLimitError(f"max_decoded_bytes must be >= 0, not {max_decoded_bytes}")
        return max_decoded_bytes, "max_decoded_bytes"
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        try:
            value = int(raw.replace("_", ""))
        except ValueError:
            value = -1
        if value < 0:
            raise InvalidLimitError(
                f"{ENV_VAR}={raw[:40]!r} is not a byte count; set it to a non-negative "
                f"integer such as {8 << 30} (8 GiB), or unset it"
            )
        return value, ENV_VAR
    return default_limit(file_size), "the default"


class DecodeBudget:
    """The bytes one open of one file may still decode.

    Args:
        where: The file, for messages.
        file_size: Its size in bytes.
        max_decoded_bytes: The caller's limit, if any (see :func:`resolve_limit`).

    Attributes:
        limit: The most bytes this open may decode.
        used: The bytes charged so far.
        requested: The caller's ``max_decoded_bytes``, for a second pass over one file.
    """

    def __init__(self, where: str, file_size: int, max_decoded_bytes: int | None = None) -> None:
        self.where, self.file_size, self.requested = where, file_size, max_decoded_bytes
        self.limit, self._origin = resolve_limit(file_size, max_decoded_bytes)
        self.used = 0

    def charge(self, what: str, nbytes: int) -> None:
        """Account for ``nbytes`` about to be decoded for ``what`` (such as ``array 'w'``).

        Raises:
            FormatError: The total would pass the limit; nothing has been allocated yet.
        """
        total = self.used + max(nbytes, 0)
        if total > self.limit:
            raise FormatError(
                f"{self.where}: {what[:200]} would decode {nbytes} bytes, {total} in all, "
                f"over the limit of {self.limit} bytes ({self._origin}) for this "
                f"{self.file_size}-byte file; if you trust the file, raise the limit with "
                f"max_decoded_bytes= or the environment variable {ENV_VAR}"
            )
        self.used = total

    def charge_name(self, name: str) -> None:
        """Account for the bookkeeping of one more name (a path, a dict key)."""
        self.charge(f"name {name[:80]!r}", NAME_COST + len(name))
