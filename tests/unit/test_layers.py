"""The package's layering (DESIGN.md): each layer imports only layers below it, and nothing closes a
cycle. Every import counts, function-local ones and those under ``TYPE_CHECKING`` included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import import_graph as ig  # noqa: E402  (tests/import_graph.py: the graph, read from the source)

# Bottom to top. A module belongs to the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("mmpipe.config", "mmpipe.errors", "mmpipe.rundir", "mmpipe.devices"),
    ("mmpipe.kernels",),
    ("mmpipe.parallel", "mmpipe.graph"),
    ("mmpipe.stages", "mmpipe.memory", "mmpipe.data"),
    ("mmpipe.models", "mmpipe.sched"),
    ("mmpipe.assemble",),
    ("mmpipe.runtime",),
    ("mmpipe.report",),
    ("mmpipe.train", "mmpipe.generate", "mmpipe.eval", "mmpipe.serve"),
    ("mmpipe.cli", "mmpipe"),
)
# Drivers are leaves: none imports another (each may import only the layers below). ``mmpipe profile``
# calibrates by training, so it is part of the training driver (mmpipe.train.profile).
DRIVERS = ("mmpipe.train", "mmpipe.generate", "mmpipe.eval", "mmpipe.serve")


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the prefix that placed it)."""
    best: tuple[int, str] | None = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (i, prefix)
    if best is None:
        raise KeyError(f"module {module} is in no layer: add it to LAYERS")
    return best


def violations(edges: list[ig.Import]) -> list[str]:
    """Every import that goes up a layer or from one driver into another, as ``file:line``."""
    found = []
    for e in edges:
        (src, src_prefix), (dst, dst_prefix) = layer_of(e.source), layer_of(e.target)
        if dst > src or (src == dst and src_prefix in DRIVERS and src_prefix != dst_prefix):
            found.append(
                f"{e.path}:{e.line}: {e.source} (layer {src}, {src_prefix}) imports {e.target} (layer {dst}, {dst_prefix})"
            )
    return sorted(set(found))


def cycle_edges(edges: list[ig.Import]) -> list[str]:
    """The imports inside each cycle, as ``file:line``."""
    found = []
    for component in ig.cycles(edges):
        members = set(component)
        found += [
            f"{e.path}:{e.line}: {e.source} -> {e.target}"
            for e in edges
            if e.source in members and e.target in members and not e.type_only
        ]
    return sorted(set(found))


def test_every_module_has_a_layer() -> None:
    files, _ = ig.imports()
    for module in files:
        layer_of(module)


def test_no_import_goes_up_a_layer() -> None:
    _, edges = ig.imports()
    bad = violations(edges)
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    _, edges = ig.imports()
    bad = cycle_edges(edges)
    assert not bad, "imports that close a cycle:\n" + "\n".join(bad)


def test_an_injected_back_edge_is_caught(tmp_path: Path) -> None:
    """A copy of the package with one import going up (kernels -> runtime) and one cycle fails both checks."""
    import shutil

    for folder in ig.PACKAGE_DIRS:
        shutil.copytree(ig.ROOT / folder, tmp_path / folder)
    registry = tmp_path / "kernels" / "registry.py"
    registry.write_text(registry.read_text() + "\n\ndef _f():\n    from mmpipe.runtime import executor  # noqa\n")
    files, edges = ig.imports(tmp_path)
    bad = violations(edges)
    assert any(v.startswith("kernels/registry.py:") and "mmpipe.runtime.executor" in v for v in bad), bad
    assert any("mmpipe.kernels.registry" in c for c in cycle_edges(edges)) or "mmpipe.runtime.executor" in str(bad)


@pytest.mark.parametrize("module", ["mmpipe.cli", "mmpipe.assemble.planning"])
def test_planning_does_not_import_the_training_driver(module: str) -> None:
    """``mmpipe plan`` (the CLI, then the assembly) never reaches the training driver or the runtime."""
    _, edges = ig.imports()
    g = ig.graph([e for e in edges if not (e.source == "mmpipe.cli" and e.local)])
    import networkx as nx

    reached = nx.descendants(g, module) if module in g else set()
    assert not {m for m in reached if m.startswith(("mmpipe.train", "mmpipe.runtime"))}


def test_every_function_local_import_says_why() -> None:
    """An import inside a function keeps start-up light (CLI dispatch) or guards an optional
    dependency, and a comment says which; any other import belongs at the top of its module."""
    missing = [f"{i.path}:{i.line}: {i.text}" for i in ig.local_imports() if not i.reason]
    assert not missing, "function-local imports without a comment giving the reason:\n" + "\n".join(missing)


def test_a_local_import_without_a_reason_is_caught(tmp_path: Path) -> None:
    import shutil

    for folder in ig.PACKAGE_DIRS:
        shutil.copytree(ig.ROOT / folder, tmp_path / folder)
    registry = tmp_path / "kernels" / "registry.py"
    registry.write_text(registry.read_text() + "\n\ndef _f():\n    import json\n\n    return json\n")
    bare = [i for i in ig.local_imports(tmp_path) if not i.reason]
    assert [(i.path, i.text) for i in bare] == [("kernels/registry.py", "import json")]
