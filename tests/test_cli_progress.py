"""Progress on a terminal and silence elsewhere: the bar of ``verify`` and of a vault save
(``Vault.save(progress=True)``), which keeps showing its elapsed time while the save
compresses and writes without reporting bytes."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import weightvault  # noqa: E402
from weightvault._base.progress import Progress  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class Terminal(io.StringIO):
    """A stream that says it is a terminal, and keeps what was drawn on it."""

    def isatty(self) -> bool:
        return True


def model(mib: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"w{i}": torch.randn(256, 1024) for i in range(mib)}  # 1 MiB each


def test_a_bar_counts_every_byte_from_many_threads() -> None:
    bar = Progress(8 * 1000 * 3, "counting", Terminal(), tick=10)
    threads = [threading.Thread(target=lambda: [bar(3) for _ in range(1000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    assert bar.done == 8 * 1000 * 3


def test_on_a_pipe_nothing_is_drawn_and_no_thread_runs() -> None:
    stream = io.StringIO()
    before = threading.active_count()
    with Progress(100, "quiet", stream) as bar:
        assert threading.active_count() == before
        bar(50)
        bar(50)
    assert stream.getvalue() == ""


def test_a_quiet_phase_still_shows_its_elapsed_time_until_closed() -> None:
    screen = Terminal()
    bar = Progress(100, "saving", screen, tick=0.05)
    bar(100)  # every byte hashed; now the save compresses and writes without a word
    time.sleep(1.2)
    drawn = screen.getvalue()
    assert "saving [####################] 100%" in drawn
    seconds = {int(s) for s in re.findall(r"(\d+) s +(?:\r|$)", drawn)}
    assert {0, 1} <= seconds, drawn  # redrawn as the seconds went by
    bar.close()
    after = screen.getvalue()
    assert after.endswith("\r" + " " * 79 + "\r")
    time.sleep(0.2)
    assert screen.getvalue() == after  # nothing once closed
    bar.close()  # a second close does nothing
    assert screen.getvalue() == after


def test_after_its_total_a_bar_names_the_quiet_work_and_its_seconds() -> None:
    screen = Terminal()
    with Progress(100, "saving", screen, tick=0.05, then="compressing and writing") as bar:
        bar(40)
        assert "[########            ]  40%" in bar.line(time.monotonic())
        bar(60)
        time.sleep(1.2)
        now = time.monotonic()
        m = re.fullmatch(
            r"saving: compressing and writing  (\d+) s  \(after 100 B in 0 s\)", bar.line(now)
        )
        assert m and int(m[1]) >= 1
        bar.phase("writing", 10)  # a save that reports its writes counts them as such
        assert bar.line(time.monotonic()).startswith(f"writing [{' ' * 20}]   0%  0 B / 10 B")
    assert re.search(r"saving: compressing and writing  [1-9]\d* s", screen.getvalue())


class GoneTerminal(Terminal):
    """A terminal that hung up: every write fails."""

    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def test_a_terminal_that_went_away_never_fails_the_save(tmp_path: Path) -> None:
    with Progress(1 << 20, "saving", GoneTerminal(), tick=0.01) as bar:
        weightvault.Vault(tmp_path / "v").save(model(1), progress=bar)
        time.sleep(0.05)  # the ticker too
        assert not bar.on and bar.done == 1 << 20


def test_unknown_total_and_a_second_phase() -> None:
    screen = Terminal()
    with Progress(0, "hashing", screen, tick=10) as bar:
        bar(3 << 20)
        assert bar.line(time.monotonic()).startswith("hashing  3.0 MiB  ")
        bar.phase("writing", 2 << 20)
        bar(1 << 20)
        assert bar.line(time.monotonic()).startswith("writing [##########          ]  50%")


def test_vault_save_with_a_bar_counts_the_tensors_it_hashes(tmp_path: Path) -> None:
    screen = Terminal()
    tensors = model()
    with Progress(4 << 20, "saving", screen, tick=0.05) as bar:
        vault = weightvault.Vault(tmp_path / "v")
        vault.save(tensors, progress=bar)
        assert bar.done == sum(t.numel() * 4 for t in tensors.values())  # written
        assert not bar._closed.is_set()  # the caller's bar: the caller closes it
        # The bar hears the hashing, then counts the bytes compressed and written anew:
        # all 4 MiB the first time, none the second (the vault holds these tensors).
        assert bar.label == "saving: writing"
        vault.save(model(2), progress=bar)
        assert bar.done == 0
    assert "saving [" in screen.getvalue()
    drawn = screen.getvalue()
    assert "saving: writing [" in drawn
    # Full when the last object is written (a long rate may cut the label to "wri...").
    assert re.search(r"saving: wri(ting|\.\.\.) \[#{20}\] 100%", drawn), drawn


def test_save_progress_true_draws_on_a_terminal_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    vault = weightvault.Vault(tmp_path / "v")
    vault.save(model(), "first", progress=True)
    drawn = screen.getvalue()
    # Hashed (the bar), then compressing and writing, which reports no bytes.
    assert "saving first [" in drawn
    assert "saving first: compressing and writing  0 s  (after 4.0 MiB in 0 s)" in drawn
    assert drawn.endswith(" " * 79 + "\r")  # the line is cleared at the end
    # In the background too: the bar is closed when the save ends.
    handle = vault.save(model(2), progress=True, background=True)
    handle.wait()
    assert screen.getvalue().endswith(" " * 79 + "\r")
    assert not [t for t in threading.enumerate() if t.name == "weightvault-progress"]
    monkeypatch.undo()
    capsys.readouterr()
    vault.save(model(3), progress=True)  # stderr is pytest's capture, not a terminal
    assert capsys.readouterr().err == ""


SAVE = """
import sys, torch, weightvault
torch.manual_seed(0)
tensors = {f"w{i}": torch.randn(256, 1024) for i in range(8)}
weightvault.Vault(sys.argv[1]).save(tensors, progress=True)
print("saved")
"""


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_real_terminal_gets_the_bar_and_a_pipe_gets_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "-c", SAVE]
    piped = subprocess.run(
        [*argv, str(tmp_path / "a")], capture_output=True, text=True, env=env, timeout=120
    )
    assert piped.returncode == 0 and piped.stdout == "saved\n" and piped.stderr == ""
    leader, follower = os.openpty()
    try:
        proc = subprocess.run(
            [*argv, str(tmp_path / "b")],
            stdout=subprocess.PIPE,
            stderr=follower,
            env=env,
            timeout=120,
        )
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: everything was read
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
    assert proc.returncode == 0 and proc.stdout == b"saved\n"
    assert b"saving [" in drawn
    assert b"saving: compressing and writing  " in drawn and b"(after 8.0 MiB in " in drawn
