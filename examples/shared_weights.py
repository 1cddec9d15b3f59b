"""The three seed problems, rebuilt in PyTorch and solved with weightvault.

Run with ``make demo`` (or ``.venv/bin/python examples/shared_weights.py``). Every number
printed is computed on the spot; files go to a temporary folder that is removed at the end.

(a) Four ``nn.Linear(2048, 2048)`` layers share one weight and bias. MXNet Gluon's
    ``save_parameters`` wrote the weight four times and Keras saves shared variables once
    per layer. Here several writers save the same model and we compare what they write.
(b) Loading into a model that has only some of the layers, or whose layer attribute was
    renamed (``l1`` -> ``l2``), which Gluon refused with "Parameter 'l2.weight' is missing".
(c) Freezing a 3x3 convolution kernel: one SGD step must leave the output at 42 (it moves
    to 41.58 when the kernel is trainable), and the frozen state survives a save and load.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file as st_load_file, save_file, save_model
from torch import nn

import weightvault
import weightvault.torch as wv
from weightvault import KeyMismatchError, LoadReport

SIZE = 2048


# ---------------------------------------------------------------------------- helpers


def heading(text: str) -> None:
    """Print a section heading underlined with ``=``."""
    print()
    print(text)
    print("=" * len(text))


def table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> None:
    """Print ``rows`` as an aligned table; the first row is the header.

    Args:
        rows: Cells as strings, one list per row.
        right: Indexes of columns to right-align (numbers).
    """
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  " + "  ".join(parts).rstrip()

    print(line(rows[0]))
    print(line(["-" * w for w in widths]))
    for r in rows[1:]:
        print(line(r))


def mib(n: int) -> str:
    """``n`` bytes as MiB with two decimals."""
    return f"{n / 2**20:.2f} MiB"


def show_report(report: LoadReport) -> None:
    """Print every field of a :class:`LoadReport`, one per line."""
    fields = ["loaded", "renamed", "missing", "unexpected", "mismatched", "untied", "tied"]
    fields.append("frozen")
    width = max(len(f) for f in fields)
    for f in fields:
        print(f"    {f.ljust(width)} = {getattr(report, f)}")
    print(f"    {'ok'.ljust(width)} = {report.ok}")


# ------------------------------------------------------------- (a) four shared layers


class FourShared(nn.Module):
    """Four dense layers that share one weight and one bias (the Gluon ``Foo`` model)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(SIZE, SIZE)
        self.l2 = nn.Linear(SIZE, SIZE)
        self.l3 = nn.Linear(SIZE, SIZE)
        self.l4 = nn.Linear(SIZE, SIZE)
        for layer in (self.l2, self.l3, self.l4):
            layer.weight = self.l1.weight
            layer.bias = self.l1.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(self.l3(self.l2(self.l1(x))))


class OnlyL3(nn.Module):
    """A model that has only one of the four layers."""

    def __init__(self) -> None:
        super().__init__()
        self.l3 = nn.Linear(SIZE, SIZE)


def part_a(folder: str) -> str:
    """Save the four-layer model with each writer and compare the files.

    Returns:
        The path of the weightvault file, used again in part (b).
    """
    heading("(a) Four nn.Linear(2048, 2048) layers sharing one weight and bias")
    torch.manual_seed(0)
    model = FourShared()
    state = model.state_dict()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"  state_dict names: {len(state)}; distinct parameters: {n_params:,} values")

    one_layer = os.path.join(folder, "one_layer.safetensors")
    wv.save(nn.Linear(SIZE, SIZE), one_layer)
    baseline = os.path.getsize(one_layer)

    paths = {
        "weightvault": os.path.join(folder, "four.wv.safetensors"),
        "torch.save": os.path.join(folder, "four.pt"),
        "save_model": os.path.join(folder, "four.save_model.safetensors"),
        "per-name": os.path.join(folder, "four.copies.safetensors"),
    }
    report = wv.save(model, paths["weightvault"])
    torch.save(state, paths["torch.save"])
    save_model(model, paths["save_model"])
    # What Gluon's save_parameters and Keras did: every name gets its own copy.
    save_file({k: v.detach().clone() for k, v in state.items()}, paths["per-name"])
    try:
        save_file(state, os.path.join(folder, "refused.safetensors"))
        refusal = "accepted (unexpected)"
    except RuntimeError as e:
        first = " ".join(str(e).split())
        refusal = f"{type(e).__name__}: {first[:44]}..."

    def st_names(path: str) -> str:
        return str(len(st_load_file(path)))

    def wv_names(path: str) -> str:
        return str(len(wv.load_file(path)))

    rows = [
        ["writer", "file size", "x one layer", "names (1)", "names (2)"],
        [
            "weightvault.torch.save(model)",
            *sized(paths["weightvault"], baseline),
            st_names(paths["weightvault"]),
            wv_names(paths["weightvault"]),
        ],
        [
            "torch.save(model.state_dict())",
            *sized(paths["torch.save"], baseline),
            "n/a",
            "n/a",
        ],
        [
            "safetensors.torch.save_model(model)",
            *sized(paths["save_model"], baseline),
            st_names(paths["save_model"]),
            wv_names(paths["save_model"]),
        ],
        [
            "save_file(every name cloned) [Gluon/Keras]",
            *sized(paths["per-name"], baseline),
            st_names(paths["per-name"]),
            wv_names(paths["per-name"]),
        ],
    ]
    table(rows, right=[1, 2, 3, 4])
    print("  (1) names safetensors.torch.load_file returns; (2) names wv.load_file returns")
    print(f"  x one layer: against one nn.Linear(2048, 2048) alone ({mib(baseline)})")
    n_pt = len(torch.load(paths["torch.save"]))
    print(f"  torch.load of the .pt pickle gives {n_pt} names (torch.save shares storages too)")
    print(f"  safetensors.torch.save_file(model.state_dict()) refuses:\n    {refusal}")

    with safe_open(paths["save_model"], "pt") as f:
        keys = sorted(f.keys())
    print(f"  save_model keeps tensors {keys}: l2..l4 are only metadata entries,")
    print("    so safetensors.torch.load_file drops them (weightvault reads them as aliases)")

    loaded = wv.load_file(paths["weightvault"])
    shared = loaded["l4.weight"] is loaded["l1.weight"]
    print(
        f"  weightvault stored {report.stored} plus {len(report.aliases)} aliases "
        f"and saved {mib(report.bytes_saved)}"
    )
    print(f"  after wv.load_file, loaded['l4.weight'] is loaded['l1.weight']: {shared}")
    info = weightvault.inspect(paths["weightvault"])
    for kept in info.stored:
        names = [a for a, k in info.aliases.items() if k == kept]
        print(f"  weightvault.inspect: {kept} is also {', '.join(names)}")
    return paths["weightvault"]


def sized(path: str, baseline: int) -> list[str]:
    """File size of ``path`` and its ratio to ``baseline``, as table cells."""
    size = os.path.getsize(path)
    return [mib(size), f"{size / baseline:.2f}x"]


# ----------------------------------------------------------- (b) subsets and renames


class Foo(nn.Module):
    """One dense layer under the attribute ``l1`` (the Gluon ``Foo`` model)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)


class Foo2(nn.Module):
    """The same layer under the attribute ``l2`` (the Gluon ``Foo2`` model)."""

    def __init__(self) -> None:
        super().__init__()
        self.l2 = nn.Linear(16, 16)


def part_b(folder: str, four_path: str) -> None:
    """Load into a subset of the layers, then into a model whose attribute was renamed."""
    heading("(b) Loading into a subset model and into a renamed model")
    subset = OnlyL3()
    report = wv.load(subset, four_path)
    full = wv.load_file(four_path)
    same = torch.equal(subset.l3.weight, full["l1.weight"])
    print("  wv.load(OnlyL3(), four-layer file): l3.* is one of the tied names in the file")
    show_report(report)
    print(f"    l3.weight equals the stored l1.weight: {same}")

    print()
    torch.manual_seed(1)
    foo = Foo()
    path = os.path.join(folder, "foo.safetensors")
    wv.save(foo, path)
    foo2 = Foo2()
    print("  torch: Foo2().load_state_dict(Foo().state_dict()) ->", end=" ")
    try:
        Foo2().load_state_dict(foo.state_dict())
    except RuntimeError as e:
        print(f"{type(e).__name__}: {str(e).splitlines()[1].strip()}")
    print("  weightvault: wv.load(Foo2(), 'foo.safetensors') ->")
    try:
        wv.load(foo2, path)
        raise SystemExit("expected a KeyMismatchError")
    except KeyMismatchError as e:
        print("    " + str(e).replace(path, "foo.safetensors").replace("\n", "\n    "))
        rule = e.rule
    print(f"  proposed rule (KeyMismatchError.rule): {rule!r}")
    assert rule is not None
    report = wv.load(foo2, path, rules=[rule])
    print(f"  wv.load(Foo2(), 'foo.safetensors', rules=[{rule!r}]):")
    show_report(report)
    same = torch.equal(foo2.l2.weight, foo.l1.weight) and torch.equal(foo2.l2.bias, foo.l1.bias)
    print(f"    Foo2.l2 now equals Foo.l1: {same}")


# -------------------------------------------------------------------- (c) freezing


class ConvNet(nn.Module):
    """One 1->1 channel 3x3 convolution without bias, kernel ``[[1, 2, 3]] * 3``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, bias=False)
        with torch.no_grad():
            self.conv.weight.copy_(kernel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def kernel() -> torch.Tensor:
    """The seed's kernel (and input), shaped ``(1, 1, 3, 3)``."""
    return torch.tensor([[1.0, 2.0, 3.0]] * 3).reshape(1, 1, 3, 3)


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One SGD step on ``loss = model(x).sum()``.

    When every parameter is frozen nothing in the graph needs a gradient, so there is
    nothing to backpropagate; ``opt.step()`` still runs.
    """
    opt.zero_grad()
    loss = model(x).sum()
    if loss.requires_grad:
        loss.backward()
    opt.step()


def run_step(frozen: bool) -> tuple[float, float, list[str]]:
    """Output before and after one SGD step (lr 0.01), and the names frozen."""
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    names = wv.freeze(model, "conv.weight", optimizer=opt) if frozen else []
    x = kernel()
    with torch.no_grad():
        before = model(x).item()
    sgd_step(model, opt, x)
    with torch.no_grad():
        after = model(x).item()
    return before, after, names


def part_c(folder: str) -> None:
    """Freeze a 3x3 kernel, take one SGD step, save, load and check it is still frozen."""
    heading("(c) Freezing a 3x3 conv kernel (one SGD step, lr 0.01, loss = output.sum())")
    b_frozen, a_frozen, names = run_step(frozen=True)
    b_free, a_free, _ = run_step(frozen=False)
    table(
        [
            ["kernel", "output before", "output after"],
            [f"frozen {names}", f"{b_frozen:g}", f"{a_frozen:g}"],
            ["trainable", f"{b_free:g}", f"{a_free:.2f}"],
        ],
        right=[1, 2],
    )

    model = ConvNet()
    wv.freeze(model, "conv.weight")
    path = os.path.join(folder, "conv.safetensors")
    saved = wv.save(model, path)
    print(f"  wv.save(...).frozen = {saved.frozen}")
    print(f"  weightvault.inspect(...).frozen = {weightvault.inspect(path).frozen}")

    fresh = ConvNet()
    print(f"  fresh ConvNet(): conv.weight.requires_grad = {fresh.conv.weight.requires_grad}")
    report = wv.load(fresh, path, restore_frozen=True)
    print(f"  wv.load(fresh, path, restore_frozen=True): report.frozen = {report.frozen}")
    print(f"    conv.weight.requires_grad = {fresh.conv.weight.requires_grad}")
    print(f"    wv.trainable(fresh) = {wv.trainable(fresh)}")
    opt = torch.optim.SGD(fresh.parameters(), lr=0.01)
    x = kernel()
    sgd_step(fresh, opt, x)
    with torch.no_grad():
        after = fresh(x).item()
    print(f"    output after one SGD step over fresh.parameters(): {after:g}")


def main() -> int:
    """Run the three parts in a temporary folder."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"weightvault {weightvault.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="weightvault-demo-") as folder:
        four = part_a(folder)
        part_b(folder, four)
        part_c(folder)
    print()
    print("done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
