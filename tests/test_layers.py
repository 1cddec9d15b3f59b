"""The package's import graph has no cycle, and no module imports one of a higher layer.

The graph is read from the source with :mod:`ast`, function-level imports included, so a
lazy ``from .x import y`` inside a function counts as much as one at the top. The layers
are those drawn in docs/architecture.md; a new module must be given one here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "weightvault"

#: Lowest first. A module's layer is that of its folder (``_vault.writing.commit`` is in
#: ``_vault``), so a new module in an existing folder needs no entry here; the public
#: top-level modules are named one by one. A module may import its own layer (acyclically)
#: and any below.
LAYERS: list[tuple[str, set[str]]] = [
    ("base: errors, types, dtypes, reports, limits, atomic files", {"_base"}),
    ("one file: header, manifest, sharing plan, writer, reader, arrays", {"_file"}),
    ("loading by name: rules, transforms, load plan", {"_load", "rules"}),
    ("training state, framework-free", {"_training"}),
    ("frameworks' private halves", {"_torch", "_keras", "_numpy", "_jax"}),
    ("foreign formats and the opener", {"formats"}),
    ("whole-file tools: inspect, convert", {"_tools"}),
    ("adapters", {"torch", "keras", "numpy", "jax"}),
    ("the vault", {"_vault"}),
    ("rank collectives: world, agree, announce", {"_ranks"}),
    ("distributed: DCP", {"dcp", "_dcp"}),
    ("training loops", {"integrations"}),
    ("facade", {""}),
    ("command line", {"_cli", "__main__"}),
]


def unit(module: str) -> str:
    """The folder (or public top-level module) that places ``module`` in a layer."""
    return module.split(".")[0]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(package: list[str], node: ast.ImportFrom, modules: set[str]) -> set[str]:
    """The package modules ``node`` imports (``from . import x`` imports module ``x``)."""
    if node.level == 0:
        if not (node.module or "").startswith("weightvault"):
            return set()
        base = (node.module or "").split(".")[1:]
    else:
        base = package[: len(package) - (node.level - 1)] + (
            node.module.split(".") if node.module else []
        )
    found = set()
    for alias in node.names:
        sub = ".".join([*base, alias.name])
        if sub in modules:
            found.add(sub)
        elif ".".join(base) in modules:
            found.add(".".join(base))  # a name defined in the module (or package) itself
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}``, names relative to ``weightvault`` (``""`` is it)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        parts = name.split(".") if name else []
        package = parts if path.name == "__init__.py" else parts[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                deps |= _resolve(package, node, modules)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("weightvault."):
                        sub = alias.name.split(".", 1)[1]
                        if sub in modules:
                            deps.add(sub)
        graph[name] = deps - {name}
    return graph


def _layer_of(
    graph: dict[str, set[str]] | None = None, layers: list[tuple[str, set[str]]] = LAYERS
) -> dict[str, int]:
    """``{module: layer index}`` for every module of ``graph`` (the package's), by folder."""
    units: dict[str, int] = {}
    for i, (_, members) in enumerate(layers):
        for m in members:
            assert m not in units, f"{m!r} is in two layers"
            units[m] = i
    graph = import_graph() if graph is None else graph
    return {m: units[unit(m)] for m in graph if unit(m) in units}


def upward_imports(
    graph: dict[str, set[str]], layers: list[tuple[str, set[str]]] = LAYERS
) -> list[str]:
    """Each import in ``graph`` of a module in a higher layer than the importer's."""
    layer = _layer_of(graph, layers)
    return [
        f"{m or 'weightvault'} ({layers[layer[m]][0]}) "
        f"imports {d or 'weightvault'} ({layers[layer[d]][0]})"
        for m, deps in graph.items()
        for d in sorted(deps)
        if m in layer and d in layer and layer[d] > layer[m]
    ]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``, each as the path that closes it (first module last too)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_every_module_has_a_layer() -> None:
    missing = sorted(set(import_graph()) - set(_layer_of()))
    assert not missing, f"give these modules a layer in LAYERS: {missing}"


def test_no_module_imports_a_higher_layer() -> None:
    bad = upward_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_fail_on_an_upward_import_and_on_a_cycle() -> None:
    # The checkers on a graph small enough to know the answer: they must find what they
    # are there to find, or the package's passing them proves nothing.
    layers = [("low", {"_low"}), ("mid", {"mid"}), ("high", {""})]
    fine = {"_low.a": set(), "_low.b": {"_low.a"}, "mid": {"_low.b"}, "": {"mid", "_low.a"}}
    assert upward_imports(fine, layers) == []
    assert import_cycles(fine) == []
    up = {**fine, "_low.a": {"mid"}}
    assert upward_imports(up, layers) == ["_low.a (low) imports mid (mid)"]
    assert import_cycles(up) == [["_low.a", "mid", "_low.b", "_low.a"]]
    assert upward_imports({**fine, "mid": {""}}, layers) == ["mid (mid) imports weightvault (high)"]


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("_dcp.peers", "integrations.transformers"),  # DCP's half on a training loop
        ("dcp", "integrations.lightning"),
        ("_ranks.failures", "_dcp.peers"),  # the rank collectives on DCP
        ("_ranks.world", "dcp"),
        ("_vault.vault", "_ranks.world"),
    ],
)
def test_the_layers_forbid_distributed_importing_loops_and_ranks_importing_either(
    importer: str, imported: str
) -> None:
    # The package's own graph with one import added that the layers forbid: DCP once
    # stood in one layer with the training loops, so its half could lean on a loop's
    # helper and no check saw it.
    graph = import_graph()
    assert importer in graph and imported in graph, "a module of this test was renamed"
    layer = _layer_of(graph)
    assert upward_imports({**graph, importer: graph[importer] | {imported}}) == [
        f"{importer} ({LAYERS[layer[importer]][0]}) imports {imported} "
        f"({LAYERS[layer[imported]][0]})"
    ]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from . import _a, _b", {"_a", "_b"}),
        ("def f():\n    from ._a import x", {"_a"}),
        ("from .formats.mxnet import open_mxnet", {"formats.mxnet"}),
        ("from . import __version__", {""}),
    ],
)
def test_the_walk_sees_lazy_and_package_imports(source: str, expected: set[str]) -> None:
    # The walk itself must find what a cycle would be made of, or the tests above prove
    # nothing.
    modules = {"", "_a", "_b", "formats", "formats.mxnet"}
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found |= _resolve([], node, modules)
    assert found == expected


def test_no_module_imports_another_folders_private_names() -> None:
    # A name with a leading underscore is private to its folder; a folder that needs
    # another's helper asks for a public name, so the owner knows who depends on it.
    bad = []
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        parts = name.split(".") if name else []
        package = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                if not (node.module or "").startswith("weightvault."):
                    continue
                target = (node.module or "").split(".")[1:]
            else:
                target = package[: len(package) - (node.level - 1)] + (
                    node.module.split(".") if node.module else []
                )
            if unit(".".join(target)) == unit(name):
                continue
            bad += [
                f"{name}: {'.'.join(target)}.{a.name}"
                for a in node.names
                if a.name.startswith("_")
                and not a.name.startswith("__")
                and ".".join([*target, a.name]) not in import_graph()
            ]
    assert not bad, "\n".join(bad)


#: Inside the vault, lowest first: a folder of ``_vault`` imports its own folder and those
#: below it; ``vault.py``, ``walk.py`` and ``adapters.py`` (the facade) sit above them all.
VAULT_LAYERS = ["store", "objects", "records", "writing", "upkeep", "travel"]


def vault_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import inside ``_vault`` of a folder in a higher vault layer than the importer's."""

    def level(module: str) -> int | None:
        parts = module.split(".")
        if parts[0] != "_vault" or len(parts) == 1:
            return None  # outside the vault, or the vault package itself
        return VAULT_LAYERS.index(parts[1]) if parts[1] in VAULT_LAYERS else len(VAULT_LAYERS)

    found = []
    for m, deps in graph.items():
        a = level(m)
        for d in sorted(deps):
            b = level(d)
            if a is not None and b is not None and b > a:
                found.append(f"{m} imports {d}")
    return found


def test_inside_the_vault_no_folder_imports_a_higher_one() -> None:
    assert vault_upward_imports(import_graph()) == []


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("_vault.writing.commit", "_vault.upkeep.gc"),  # the upward import the lease removed
        ("_vault.travel.mirror", "_vault.vault"),  # travel reaching up to the facade
        ("_vault.store.pack", "_vault.objects.address"),
    ],
)
def test_the_vault_layers_refuse_an_upward_import(importer: str, imported: str) -> None:
    graph = import_graph()
    assert importer in graph and imported in graph
    graph[importer] = graph[importer] | {imported}
    assert vault_upward_imports(graph) == [f"{importer} imports {imported}"]
