"""The one dtype table agrees with the frameworks it names, and the geometry helpers hold."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from weightvault._base.dtypes import (
    BY_FRAMEWORK_NAME,
    FRAMEWORK_NAMES,
    ITEMSIZE,
    contiguous,
    numpy_dtype,
    span,
)
from weightvault._base.errors import UnsupportedDtypeError

np = pytest.importorskip("numpy")


def test_every_dtype_has_one_framework_name() -> None:
    assert set(FRAMEWORK_NAMES) == set(ITEMSIZE)
    assert len(BY_FRAMEWORK_NAME) == len(FRAMEWORK_NAMES)


@pytest.mark.parametrize("name", sorted(ITEMSIZE))
def test_numpy_and_torch_agree_with_the_table(name: str) -> None:
    pytest.importorskip("ml_dtypes")
    assert numpy_dtype(name).itemsize == ITEMSIZE[name]
    pytest.importorskip("torch")
    from weightvault._torch.tensors import DTYPES

    assert DTYPES[name].itemsize == ITEMSIZE[name]
    assert str(DTYPES[name]) == f"torch.{FRAMEWORK_NAMES[name]}"


def test_adapters_share_one_error_and_one_table() -> None:
    pytest.importorskip("ml_dtypes")
    import weightvault.numpy as wvn
    from weightvault.formats.pickle_scan import TORCH_DTYPES

    assert wvn.UnsupportedDtypeError is UnsupportedDtypeError
    # The torch.save reader knows every dtype torch can save (FNUZ and E8M0 included).
    assert set(TORCH_DTYPES.values()) == set(ITEMSIZE)
    with pytest.raises(UnsupportedDtypeError, match="'x' has dtype float128"):
        wvn.save({"x": np.zeros(2, np.float128)}, "unused")  # float128: no safetensors name


shapes = st.lists(st.integers(1, 4), max_size=4).map(tuple)


@given(shapes, st.sampled_from(sorted(ITEMSIZE)))
def test_span_and_contiguity_match_numpy(shape: tuple[int, ...], dtype: str) -> None:
    a = np.empty(shape, dtype=np.uint8)
    stride = tuple(s // a.itemsize for s in a.strides)
    assert contiguous(shape, stride)
    assert span(dtype, shape, stride) == a.size * ITEMSIZE[dtype]
    if len(shape) >= 2 and shape[0] > 1 and shape[1] > 1:
        t = tuple(reversed(np.empty(tuple(reversed(shape)), np.uint8).strides))
        assert not contiguous(shape, t)
