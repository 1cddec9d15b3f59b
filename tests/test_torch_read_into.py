"""Reading straight into a tensor's memory, whatever strides a contiguous tensor carries."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import weightvault.torch as wv  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_size_one_tensor_with_a_wide_stride_loads(tmp_path: Path, dtype: torch.dtype) -> None:
    # Found by Hypothesis (test_properties): x[::2][:1] is contiguous by torch's rule,
    # yet its stride is 2, and reading into it raised RuntimeError.
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(4, dtype=dtype)[::2][:1])

    m = M()
    assert m.b.is_contiguous() and m.b.stride() == (2,)
    path = tmp_path / "b.safetensors"
    wv.save({"b": torch.tensor([1.5], dtype=dtype)}, path)
    wv.load(m, path)
    assert m.b.tolist() == [1.5]
