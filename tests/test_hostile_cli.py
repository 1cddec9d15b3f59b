"""Hostile input for the command line: one line and a documented exit code, never a
traceback.

Every crafted case of ``test_hostile.py``, fuzzed files and size bombs go through each
subcommand, in process and as ``python -m weightvault``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _hostile_files import TWO, TWO_DATA, _copies, _stride0_view, _write, blob
from test_hostile import CASES

# ---------------------------------------------------------------------------------------
# The command line: one line and a documented exit code, never a traceback
# ---------------------------------------------------------------------------------------


def _crafted_files(tmp_path: Path) -> list[Path]:
    """Every case of test_hostile.py, fuzzed files and bombs, each written to its own file."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_fuzz_smoke import _valid_files, case

    valid = _valid_files()
    payloads = [data for data, _ in CASES.values()]
    payloads += [case(seed, valid) for seed in range(120)]
    payloads += [_stride0_view(2**28), _copies(300, 1 << 16), *valid]
    paths = []
    for i, data in enumerate(payloads):
        paths.append(_write(tmp_path, data, f"h{i}.safetensors"))
    return paths


def test_cli_never_raises_on_hostile_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightvault._cli.app import main

    files = _crafted_files(tmp_path)
    good = files[-1]
    out = tmp_path / "out.safetensors"
    codes: set[int] = set()
    for path in files:
        for argv in (
            ["inspect", str(path)],
            ["inspect", "--json", str(path)],
            ["verify", str(path)],
            ["diff", str(good), str(path)],
            ["convert", str(path), str(out)],
        ):
            code = main(argv)  # an exception escaping main would end the CLI in a traceback
            codes.add(code)
            err = capsys.readouterr().err
            # 5: read fine, but refused (a name reserved for weightvault cannot be converted).
            assert code in (0, 1, 3, 5), (argv, code, err)
            assert "Traceback" not in err and err.count("\n") <= 1, (argv, err)
            if code in (3, 5):
                assert err.startswith(f"weightvault {argv[0]}: "), err
    assert codes == {0, 1, 3, 5}


@pytest.mark.parametrize(
    "case", ["lone_surrogate_tensor_name", "stride0_diff", "truncated", "directory"]
)
def test_cli_subprocess_prints_no_traceback(tmp_path: Path, case: str) -> None:
    import subprocess
    import sys

    good = _write(tmp_path, blob(TWO, TWO_DATA), "good.safetensors")
    if case == "stride0_diff":
        a = _write(tmp_path, _stride0_view(2**28), "a.safetensors")
        b = _write(tmp_path, _stride0_view(2**28).replace(b"\x80?", b"\x00@"), "b.safetensors")
        argv, expected = ["diff", str(a), str(b)], 3
    elif case == "truncated":
        argv, expected = ["inspect", str(_write(tmp_path, blob(TWO, TWO_DATA)[:-3]))], 3
    elif case == "directory":
        argv, expected = ["diff", str(good), str(tmp_path)], 3
    else:
        argv, expected = ["inspect", str(_write(tmp_path, CASES[case][0]))], 3
    cli = [sys.executable, "-m", "weightvault"]
    result = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == expected, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"weightvault {argv[0]}:")


def test_cli_unexpected_error_is_one_line_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug reached by some input still ends in one line; WEIGHTVAULT_DEBUG shows where."""
    from weightvault._cli import app as _cli

    def broken(path: object) -> None:
        raise KeyError("deep\ninside")

    monkeypatch.setattr(_cli, "inspect", broken)
    path = _write(tmp_path, blob(TWO, TWO_DATA))
    assert _cli.main(["inspect", str(path)]) == _cli.EXIT_UNEXPECTED == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("weightvault inspect: unexpected KeyError: 'deep\\ninside'")
    assert "WEIGHTVAULT_DEBUG=1" in err
    monkeypatch.setenv("WEIGHTVAULT_DEBUG", "1")
    assert _cli.main(["inspect", str(path)]) == 4
    assert "Traceback" in capsys.readouterr().err
