"""Keras' own ``.weights.h5`` files read under weightvault's names of the target model.

Keras names a variable in its files by a path it computes on the model being loaded
(``layers/dense/vars/0``); :func:`as_ours` computes the same paths
(:func:`weightvault._keras.walk.walk`) and presents the file under weightvault's names,
so the load plan matches them like any other file's.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._base.errors import FormatError
from .._file.checkpoint import Checkpoint
from .._file.header import TensorInfo
from .._file.manifest import Manifest, View
from .walk import KERAS_FILE_NAME, Var


class Renamed(Checkpoint):
    """A checkpoint whose names are translated; bytes come from the one it wraps.

    Used to read Keras' ``<path>/vars/<i>`` names as weightvault names of the target
    model, before the user's own rules apply. Names mapped to ``None`` disappear (their
    bytes stay, since another name may be a copy of them).
    """

    def __init__(self, inner: Checkpoint, mapping: Mapping[str, str | None]) -> None:
        self._inner = inner
        m = inner.manifest

        def keep(n: str) -> bool:
            return mapping.get(n, n) is not None

        def new(n: str) -> str:
            return mapping.get(n) or n

        stored: dict[str, TensorInfo] = {}
        self._back: dict[str, str] = {}
        for s, info in inner.stored.items():
            stored[new(s)] = TensorInfo(new(s), info.dtype, info.shape, info.start, info.end)
            self._back[new(s)] = s
        manifest = Manifest(
            aliases={new(a): new(k) for a, k in m.aliases.items() if keep(a)},
            copies={new(c): new(k) for c, k in m.copies.items() if keep(c)},
            views={
                new(n): View(new(v.base), v.dtype, v.shape, v.stride, v.offset)
                for n, v in m.views.items()
                if keep(n)
            },
            frozen=[new(n) for n in m.frozen if keep(n)],
            names=[new(n) for n in m.names if keep(n)],
            sums={new(k): v for k, v in m.sums.items()},
            checksum=m.checksum,
            metadata=m.metadata,
            version=m.version,
            ours=m.ours,
        )
        super().__init__(inner.path, stored, manifest)

    @property
    def size(self) -> int:
        return self._inner.size

    @property
    def framework(self) -> str | None:
        return self._inner.framework

    def raw(self, stored: str) -> memoryview:
        return self._inner.raw(self._back[stored])

    def mapped(self, stored: str) -> memoryview:
        return self._inner.mapped(self._back[stored])

    def check(self, stored: str) -> bool:
        return self._inner.check(self._back[stored])

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        return self._inner.read_into(self._back[stored], buffer)

    def stage(self, stored: list[str], verify: bool) -> None:
        self._inner.stage([self._back[s] for s in stored], verify)


def as_ours(ckpt: Checkpoint, vs: list[Var], label: str | None = None) -> Checkpoint:
    """Read a Keras-written file (``layers/dense/vars/0``) under the target's names.

    Keras matches its files by these paths, computed on the target model; so do we. The
    optimizer's state is not for the model and is dropped. ``label`` names the file (or
    archive member) in messages.

    Raises:
        FormatError: One dataset, through hard links, stands for variables of different
            shapes.
    """
    ours = {v.name for v in vs}
    names = ckpt.names
    if any(n in ours for n in names) or not any(KERAS_FILE_NAME.search(n) for n in names):
        return ckpt
    _check_links(ckpt, vs, label or ckpt.path)
    mapping: dict[str, str | None] = {}
    for n in names:
        if n.startswith("optimizer/"):
            mapping[n] = None
    for v in vs:
        if v.keras_name:
            mapping.setdefault(v.keras_name, v.name)
    # Readers may write "/layers/..." for the h5 root; accept both spellings.
    for n in names:
        if n.startswith("/") and n[1:] in mapping:
            mapping[n] = mapping[n[1:]]
    return Renamed(ckpt, mapping)


def _check_links(ckpt: Checkpoint, vs: list[Var], where: str) -> None:
    """Refuse a dataset whose hard links put it where the model holds different shapes.

    Such a file was crafted or damaged: Keras never links one dataset to two shapes.
    """
    by_path = {v.keras_name: v for v in vs if v.keras_name}
    seen: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n in ckpt.names:
        v = by_path.get(n.lstrip("/"))
        if v is None:
            continue
        shape = tuple(v.variable.shape)
        first, first_shape = seen.setdefault(ckpt.entry(n).group, (n, shape))
        if first_shape != shape:
            raise FormatError(
                f"{where}: dataset {first!r} is hard-linked as {n!r}, where this model holds "
                f"a {list(shape)} variable, but at {first!r} a {list(first_shape)} one: one "
                "dataset cannot stand for tensors of different shapes. The file is damaged "
                "or crafted; save the weights again"
            )
