"""Checking a pickle before anything loads it: the allow-list and the opcode scan.

A pickle can call any importable function while it loads, so the ``torch.save`` reader
(:mod:`.torch_pickle`) unpickles nothing before :func:`scan` has walked every opcode
with :func:`pickletools.genops` (which only parses) and checked every global the pickle
names against :data:`ALLOWED`: the tensor-rebuild functions, storage classes, dtypes and
``collections.OrderedDict``. Anything else is refused, naming the global.

The scan also refuses memo indices beyond the pickle's own length, which would make the
C unpickler size its memo table by them.
"""

from __future__ import annotations

import _compat_pickle
import pickle
import pickletools
from typing import Any

from .._base.dtypes import BY_FRAMEWORK_NAME
from .._base.errors import FormatError, capped

#: Typed storage classes -> the dtype of their elements.
STORAGES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}
#: ``torch.<dtype>`` globals that ``_rebuild_tensor_v3`` receives -> dtype names.
TORCH_DTYPES = BY_FRAMEWORK_NAME
REBUILDERS = frozenset(
    {
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
    }
)
#: Every global a weights file may name, as ``module.name``.
ALLOWED = frozenset(
    {"collections.OrderedDict", "torch.storage.UntypedStorage", "torch.UntypedStorage"}
    | {f"torch._utils.{f}" for f in REBUILDERS}
    | {f"torch.{s}" for s in STORAGES}
    | {f"torch.{d}" for d in TORCH_DTYPES}
)
#: torch.save's first pickle in the legacy (pre-1.6) format is this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
FIX_DAMAGED = "the file is truncated or damaged; save it again with torch.save"
FIX_UNSAFE = (
    "save only the weights (torch.save(model.state_dict(), path)) or, if you trust the "
    "file, load it yourself and save it with weightvault.torch.save"
)

_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING"}
    | {"SHORT_BINSTRING", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
)
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NO_PUSH_OPS = frozenset({"MEMOIZE", "PROTO", "FRAME", "STOP"} | _PUT_OPS)


class MapReader:
    """A read-only file-like view of a buffer: ``read(n)`` never allocates more than exists.

    ``pickletools.genops`` calls ``read(n)`` with lengths taken from the file; a real file
    object would allocate ``n`` bytes first, this returns what is there.
    """

    def __init__(self, buf: memoryview, start: int = 0) -> None:
        self.buf, self.pos = buf, start

    def read(self, n: int = -1) -> bytes:
        end = self.buf.nbytes if n < 0 else min(self.buf.nbytes, self.pos + n)
        out = bytes(self.buf[self.pos : end])
        self.pos = end
        return out

    def readline(self) -> bytes:
        end = self.pos
        limit = min(self.buf.nbytes, self.pos + (1 << 20))
        while end < limit and self.buf[end] != 0x0A:
            end += 1
        return self.read(end + 1 - self.pos)

    def tell(self) -> int:
        return self.pos


class _Recent:
    """The values of the last two pushes (strings where known) and what the memo holds.

    ``STACK_GLOBAL`` takes its module and name from the stack, so the scan follows the
    strings pushed, memoized and fetched back, as far as it must to name the global.
    """

    def __init__(self) -> None:
        self.memo: dict[int, object] = {}
        self.last: list[object] = []

    def track(self, name: str, arg: Any) -> None:
        top = self.last[-1] if self.last else None
        slot = arg if isinstance(arg, int) else -1
        if name in _STRING_OPS:
            self.last.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
        elif name == "MEMOIZE":
            self.memo[len(self.memo)] = top
        elif name in _PUT_OPS:
            self.memo[slot] = top
        elif name in _GET_OPS:
            self.last.append(self.memo.get(slot))
        elif name not in _NO_PUSH_OPS:
            self.last.append(None)
        del self.last[:-2]


def scan(stream: Any, where: str) -> list[str]:
    """Check every global one pickle references against :data:`ALLOWED`; nothing is run.

    Args:
        stream: A file-like object positioned at the pickle (or the pickle's bytes).
        where: The file, for messages.

    Returns:
        The globals referenced, as ``module.name``.

    Raises:
        FormatError: A global is not allowed (the message names it), a global cannot be
            resolved statically, or the pickle is malformed.

    Example:
        >>> scan(pickle.dumps(os.system), "evil.pkl")
        Traceback (most recent call last):
        FormatError: evil.pkl: refused: the pickle references 'posix.system', ...
    """
    found: list[str] = []
    recent = _Recent()
    try:
        for ops, (op, arg, _) in enumerate(pickletools.genops(stream), start=1):
            _check_memo_slot(op.name, arg, ops, where)
            qualified = _global(op.name, arg, recent.last, where)
            if qualified is not None:
                found.append(qualified)
            recent.track(op.name, arg)
    except FormatError:
        raise
    except Exception as e:  # genops raises ValueError, EOFError, UnicodeError, ...
        raise FormatError(
            f"{where}: not a valid pickle ({type(e).__name__}: {str(e)[:120]}); the file is "
            "truncated or damaged"
        ) from None
    return found


def _check_memo_slot(name: str, arg: Any, ops: int, where: str) -> None:
    # Picklers number memo slots 0, 1, 2, ...; the C unpickler sizes its memo table by
    # the largest index, so a 5-byte LONG_BINPUT could cost gigabytes.
    if name in _PUT_OPS and (not isinstance(arg, int) or not 0 <= arg < ops):
        raise FormatError(
            f"{where}: refused: the pickle stores memo slot {str(arg)[:40]} after only "
            f"{ops} opcodes, which no pickler writes; {FIX_DAMAGED}"
        )


def _global(name: str, arg: Any, recent: list[object], where: str) -> str | None:
    """The allowed global an opcode names (``None`` if it names none); refuse the rest."""
    if name in ("GLOBAL", "INST"):
        module, _, attr = str(arg).partition(" ")
        return _allow(f"{module}.{attr}", where)
    if name == "STACK_GLOBAL":
        if len(recent) < 2 or not all(isinstance(v, str) for v in recent[-2:]):
            raise FormatError(
                f"{where}: refused: the pickle builds a global from values that cannot be "
                f"checked before loading; {FIX_UNSAFE}"
            )
        return _allow(f"{recent[-2]}.{recent[-1]}", where)
    if name in ("EXT1", "EXT2", "EXT4"):
        raise FormatError(
            f"{where}: refused: the pickle references a global through the copyreg "
            f"extension registry (code {arg}), which cannot be checked; {FIX_UNSAFE}"
        )
    return None


def _allow(qualified: str, where: str) -> str:
    module, _, name = qualified.rpartition(".")
    # Protocol 2 names Python 3 modules by their Python 2 names (__builtin__ is builtins);
    # report what the unpickler would import.
    qualified = f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"
    if qualified not in ALLOWED:
        raise FormatError(
            f"{where}: refused: the pickle references {qualified[:200]!r}, which is not "
            f"tensor data and could run code when loaded (allowed: "
            f"{capped(sorted(ALLOWED), 4)}); {FIX_UNSAFE}"
        )
    return qualified


def scan_legacy(buf: memoryview, where: str) -> int:
    """Scan the pickles of a legacy ``torch.save`` file (or a plain pickle); return count.

    The legacy layout is five pickles (magic number, protocol, system info, the object,
    the storage keys) followed by raw storages, so each pickle is scanned in turn.

    Example:
        >>> scan_legacy(memoryview(pickle.dumps({"a": 1})), "plain.pkl")
        1
    """
    reader = MapReader(buf)
    start = reader.tell()
    scan(reader, where)
    # Compared as bytes: even an allowed pickle is not loaded before every one is scanned.
    if bytes(buf[start : reader.tell()]) != pickle.dumps(LEGACY_MAGIC, protocol=2):
        return 1
    for _ in range(4):
        scan(reader, where)
    return 5
