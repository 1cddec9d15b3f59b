"""Hostile sizes: work and memory stay bounded whatever a small file describes.

A file of a few hundred bytes can describe gigabytes (a stride-0 view, many copies of one
tensor): eager readers refuse it before allocating, and the limit is the caller's to
raise. Copy detection compares only lookalikes, so many same-shape tensors stay
near-linear.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import weightvault
from _hostile_files import (
    _copies,
    _stride0_view,
    _write,
    blob,
    entry,
    needs_alarm,
    needs_torch,
    time_limit,
    torch,
    with_manifest,
    wvt,
)

# ---------------------------------------------------------------------------------------
# Tiny files that describe gigabytes: refused before anything is allocated
# ---------------------------------------------------------------------------------------


def test_stride0_view_of_2_28_elements_is_refused_by_eager_reads(tmp_path: Path) -> None:
    import weightvault.numpy as wvn

    path = _write(tmp_path, _stride0_view(2**28))
    assert path.stat().st_size < 320
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"would allocate 1073741832 bytes") as e:
            wvn.load_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, peak
    assert str(path) in str(e.value) and "max_bytes" in str(e.value)
    # The header alone is fine: inspect and verify describe it without reading values.
    assert weightvault.inspect(path).tensors["v"].nbytes == 2**30
    assert weightvault.verify(path).ok


def test_stride0_view_reads_when_the_caller_raises_the_limit(tmp_path: Path) -> None:
    import numpy as np

    import weightvault.numpy as wvn

    path = _write(tmp_path, _stride0_view(2**20))
    with pytest.raises(weightvault.FormatError, match=r"more than the 1000-byte limit"):
        wvn.load_file(path, max_bytes=1000)
    out = wvn.load_file(path, max_bytes=8 << 20)
    assert out["v"].shape == (2**20,) and np.all(out["v"] == 1.0)


def test_one_environment_variable_sets_every_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WEIGHTVAULT_MAX_DECODED_BYTES limits eager safetensors reads as it limits the
    foreign readers, both ways: lower than the default, and higher."""
    import weightvault.numpy as wvn

    path = _write(tmp_path, _stride0_view(2**20))
    monkeypatch.setenv("WEIGHTVAULT_MAX_DECODED_BYTES", "1000")
    with pytest.raises(weightvault.FormatError, match="WEIGHTVAULT_MAX_DECODED_BYTES"):
        wvn.load_file(path)
    big = _write(tmp_path, _stride0_view(2**26 + 2**24), name="big.safetensors")
    with pytest.raises(weightvault.FormatError):
        monkeypatch.delenv("WEIGHTVAULT_MAX_DECODED_BYTES")
        wvn.load_file(big)  # 320 MiB from a few hundred bytes: over the default
    monkeypatch.setenv("WEIGHTVAULT_MAX_DECODED_BYTES", str(1 << 30))
    assert wvn.load_file(big)["v"].shape == (2**26 + 2**24,)


@needs_torch
def test_torch_reads_a_stride0_view_lazily(tmp_path: Path) -> None:
    """A view of its base allocates nothing, so torch reads what numpy must refuse."""
    assert wvt is not None
    path = _write(tmp_path, _stride0_view(2**28))
    for mmap in (False, True):
        out = wvt.load_file(path, mmap=mmap)
        assert out["v"].shape == (2**28,) and out["v"].stride() == (0,)
        assert out["v"].untyped_storage().nbytes() == 4


@pytest.mark.parametrize("reader", ["numpy", "keras", pytest.param("torch", marks=needs_torch)])
def test_many_copies_of_one_tensor_are_refused(tmp_path: Path, reader: str) -> None:
    import weightvault.numpy as wvn

    # 1 MiB stored, 300 copies: 300 MiB of arrays from a file of just over 1 MiB.
    path = _write(tmp_path, _copies(300, 1 << 20))
    read: Callable[[Path], Any]
    if reader == "keras":
        wvk = pytest.importorskip("weightvault.keras")
        read = wvk.load_file
    else:
        read = wvn.load_file if reader == "numpy" else wvt.load_file  # type: ignore[union-attr]
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"would allocate"):
            read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    # A few copies of a small tensor are what real files hold, and read as before.
    small = _write(tmp_path, _copies(3, 16), "small.safetensors")
    assert len(read(small)) == 4


def test_convert_refuses_to_gather_a_copy_of_a_huge_stride0_view(tmp_path: Path) -> None:
    manifest = {"version": 1, "views": {"v": ["a", "F32", [2**26], [0], 0]}, "copies": {"c": "v"}}
    src = _write(tmp_path, blob(with_manifest(manifest, {"a": entry("F32", [1], 0, 4)}), bytes(4)))
    dst = tmp_path / "out.safetensors"
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"gathering 1 views would allocate"):
            weightvault.convert(src, dst)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20 and not dst.exists()
    report = weightvault.convert(src, dst, max_bytes=1 << 30, dedupe_copies=True)
    assert report.copies == {"c": "v"}


def test_jax_load_file_refuses_a_tiny_file_that_describes_a_gigabyte(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    import numpy as np

    import weightvault.jax as wvj

    path = _write(tmp_path, _stride0_view(2**28))
    with pytest.raises(weightvault.FormatError, match=r"would allocate 1073741832 bytes") as e:
        wvj.load_file(path)
    assert str(path) in str(e.value) and "max_bytes" in str(e.value)
    small = _write(tmp_path, _stride0_view(2**20), "small.safetensors")
    with pytest.raises(weightvault.FormatError, match=r"more than the 1000-byte limit"):
        wvj.load_file(small, max_bytes=1000)
    out = wvj.load_file(small, max_bytes=8 << 20)
    assert out["v"].shape == (2**20,) and bool(np.all(np.asarray(out["v"]) == 1.0))


# ---------------------------------------------------------------------------------------
# Copy detection stays near-linear: many distinct tensors of one shape
# ---------------------------------------------------------------------------------------


def _counting_same_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from weightvault._file import sharing as _plan

    calls = [0]
    real = _plan.same_bytes

    def counted(a: Any, b: Any, chunk: int = 1 << 20) -> bool:
        calls[0] += 1
        return real(a, b, chunk)

    monkeypatch.setattr(_plan, "same_bytes", counted)
    return calls


@pytest.mark.parametrize("dedupe", [True, False])
def test_copy_detection_compares_only_lookalikes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dedupe: bool
) -> None:
    import numpy as np

    import weightvault.numpy as wvn

    calls = _counting_same_bytes(monkeypatch)
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal((4, 4)).astype(np.float32) for i in range(2000)}
    # Real copies, and a large pair equal in every sampled slice but one byte elsewhere.
    arrays["copy_a"] = arrays["t7"].copy()
    arrays["copy_b"] = arrays["t1999"].copy()
    big = np.zeros(3 << 20, np.uint8)
    arrays["big"], arrays["big_twin"] = big, big.copy()
    arrays["big_twin"][1 << 20] = 1
    report = wvn.save(arrays, tmp_path / "many.safetensors", dedupe_copies=dedupe)
    # Kept copies (the default) are still found, as duplicates, for inspect's savings.
    found = report.copies if dedupe else report.duplicates
    assert found == {"copy_a": "t7", "copy_b": "t1999"}
    # One exact comparison per true copy and one for the sampled lookalike; all pairs of
    # 2,000 same-shape arrays would be about 2 million.
    assert calls[0] == 3, calls[0]


@needs_torch
def test_inspecting_a_pt_of_distinct_tensors_compares_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert torch is not None
    calls = _counting_same_bytes(monkeypatch)
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "distinct.pt"
    torch.save({f"t{i}": torch.randn(4, 4, generator=g) for i in range(500)}, path)
    info = weightvault.inspect(path)
    assert len(info.names) == 500 and not info.copies
    assert calls[0] == 0


@needs_alarm
def test_saving_4000_same_shape_arrays_is_fast(tmp_path: Path) -> None:
    import numpy as np

    import weightvault.numpy as wvn

    rng = np.random.default_rng(1)
    arrays = {f"t{i}": rng.standard_normal(16).astype(np.float32) for i in range(4000)}
    # Pairwise comparison took about a minute; near-linear work takes well under a second.
    with time_limit(20.0):
        wvn.save(arrays, tmp_path / "many.safetensors")
