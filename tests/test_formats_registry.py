"""The format registry and the readers cannot drift apart.

Every row of ``weightvault.formats._registry.FORMATS`` must have a maker here that
writes a real file of that format (with the library that owns the format where there is
one: safetensors, numpy, h5py, torch). Each file must be detected as its row from its
bytes alone (under a name that says nothing) and read back bitwise through
``open_any``. A row added without a maker, or a maker whose file lands on another row,
fails here.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError
from weightvault.formats import FOREIGN, detect, open_any
from weightvault.formats._registry import FORMATS

h5py = pytest.importorskip("h5py")
torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

ARRAYS = {
    "w": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.array([-1.5, 0.0, 2.25], dtype=np.float32),
}


def _safetensors(path: Path) -> dict[str, np.ndarray]:
    safetensors_numpy.save_file(ARRAYS, str(path))
    return ARRAYS


def _mxnet(path: Path) -> dict[str, np.ndarray]:
    """A dict ``.params`` file of V2 dense float32 records, laid out as MXNet writes it."""
    out = struct.pack("<QQQ", 0x112, 0, len(ARRAYS))
    for a in ARRAYS.values():
        out += struct.pack(f"<Iii{a.ndim}q", 0xF993FAC9, 0, a.ndim, *a.shape)
        out += struct.pack("<iii", 1, 0, 0) + a.tobytes()  # cpu, device 0, float32
    out += struct.pack("<Q", len(ARRAYS))
    for name in ARRAYS:
        out += struct.pack("<Q", len(name)) + name.encode()
    path.write_bytes(out)
    return ARRAYS


def _hdf5(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "w") as f:
        for name, a in ARRAYS.items():
            f.create_dataset(f"layers/dense/{name}", data=a)
    return {f"layers/dense/{name}": a for name, a in ARRAYS.items()}


def _keras(path: Path) -> dict[str, np.ndarray]:
    """A ``.keras`` archive as Keras writes it: config, metadata, weights stored."""
    import io
    import zipfile

    weights = io.BytesIO()
    with h5py.File(weights, "w") as f:
        for name, a in ARRAYS.items():
            f.create_dataset(f"layers/dense/vars/{name}", data=a)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("metadata.json", json.dumps({"keras_version": "3.15.1"}))
        z.writestr("config.json", json.dumps({"class_name": "Sequential", "config": {}}))
        z.writestr("model.weights.h5", weights.getvalue())
    return {f"layers/dense/vars/{name}": a for name, a in ARRAYS.items()}


def _npy(path: Path) -> dict[str, np.ndarray]:
    with open(path, "wb") as f:
        np.save(f, ARRAYS["w"])
    return {"arr_0": ARRAYS["w"]}


def _torch_zip(path: Path) -> dict[str, np.ndarray]:
    torch.save({n: torch.from_numpy(a) for n, a in ARRAYS.items()}, path)
    return ARRAYS


def _npz(path: Path) -> dict[str, np.ndarray]:
    with open(path, "wb") as f:
        np.savez(f, **ARRAYS)
    return ARRAYS


def _legacy_torch(path: Path) -> dict[str, np.ndarray]:
    state = {n: torch.from_numpy(a) for n, a in ARRAYS.items()}
    torch.save(state, path, _use_new_zipfile_serialization=False)
    return ARRAYS


#: Format name -> a writer of a real file of it, returning what the file holds by name.
MAKERS: dict[str, Callable[[Path], dict[str, np.ndarray]]] = {
    "safetensors": _safetensors,
    "mxnet": _mxnet,
    "hdf5": _hdf5,
    "keras": _keras,
    "npy": _npy,
    "torch": _torch_zip,
    "npz": _npz,
    "pickle": _legacy_torch,
}


def test_every_format_in_the_table_has_a_maker_here() -> None:
    names = [f.name for f in FORMATS]
    assert len(names) == len(set(names))
    assert set(names) == set(MAKERS)
    assert set(names) - {"safetensors"} == FOREIGN


@pytest.mark.parametrize("kind", [f.name for f in FORMATS])
def test_each_format_is_detected_from_its_bytes_and_opened(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.bin"  # one name for all: only the bytes can tell
    expected = MAKERS[kind](path)
    assert detect(path) == kind
    with open_any(path) as ckpt:
        assert sorted(ckpt.names) == sorted(expected)
        got = wvn.load_file(ckpt)
    for name, a in expected.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        assert got[name].tobytes() == a.tobytes(), name


def test_unknown_bytes_are_refused_by_open_any(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"  # the name does not make it one
    path.write_bytes(b"GGUF" + bytes(60))
    assert detect(path) == "unknown"
    with pytest.raises(FormatError, match="not a checkpoint format weightvault reads"):
        open_any(path)


def test_a_reader_is_imported_only_when_a_file_of_its_kind_is_opened(tmp_path: Path) -> None:
    path = _safetensors_path(tmp_path)
    code = (
        "import json, sys\n"
        "from weightvault.formats import detect, open_any\n"
        f"assert detect({str(path)!r}) == 'safetensors'\n"
        f"open_any({str(path)!r}).close()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('weightvault.formats.'))))"
    )
    src = str(Path(weightvault.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    readers = {"mxnet", "npz", "keras_h5", "torch_pickle", "pickle_scan", "torch_zip"}
    assert not loaded & {f"weightvault.formats.{r}" for r in readers}, loaded


def _safetensors_path(tmp_path: Path) -> Path:
    path = tmp_path / "plain.safetensors"
    _safetensors(path)
    return path
