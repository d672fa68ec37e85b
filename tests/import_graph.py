"""The package's import graph, read from the source (every ``import``, function-local ones too).

``python tests/import_graph.py`` prints the figures of issue 28: modules, import edges inside the
package, cycles, function-local imports and the largest modules; ``--cycles`` lists the modules of
each cycle, ``--local`` every function-local import with the comment that gives its reason. ``tests/unit/test_layers.py``
holds the layering to it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package it installs as (pyproject's package-dir mapping).
PACKAGE_DIRS = {
    "mmpipe": "mmpipe",
    "stages": "mmpipe.stages",
    "sched": "mmpipe.sched",
    "memory": "mmpipe.memory",
    "kernels": "mmpipe.kernels",
}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported mmpipe module (the longest known prefix of the imported name)
    path: str  # file, relative to the repository root
    line: int
    local: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:`` (never executed)


def module_files(root: Path = ROOT) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([package, *parts])] = path
    return files


def _resolve(name: str, modules: set[str]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: set[str], path: str) -> None:
        self.module, self.is_package, self.modules, self.path = module, is_package, modules, path
        self.depth = 0
        self.type_checking = 0
        self.imports: list[Import] = []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self.type_checking += 1
            for child in node.body:
                self.visit(child)
            self.type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _add(self, name: str, line: int) -> None:
        target = _resolve(name, self.modules)
        if target is not None and target != self.module:
            self.imports.append(Import(self.module, target, self.path, line, self.depth > 0, self.type_checking > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.module.split(".")
            base = base[: len(base) - node.level + (1 if self.is_package else 0)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        for alias in node.names:  # ``from mmpipe.sched import plan`` imports the submodule
            full = f"{name}.{alias.name}"
            self._add(full if full in self.modules else name, node.lineno)


def imports(root: Path = ROOT) -> tuple[dict[str, Path], list[Import]]:
    files = module_files(root)
    found: list[Import] = []
    for module, path in files.items():
        visitor = _Visitor(module, path.name == "__init__.py", set(files), str(path.relative_to(root)))
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found.extend(visitor.imports)
    return files, found


def graph(edges: list[Import]) -> nx.DiGraph:
    g = nx.DiGraph()
    for e in edges:
        if not e.type_only:
            g.add_edge(e.source, e.target)
    return g


def cycles(edges: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (each holds at least one cycle)."""
    return sorted(
        (sorted(c) for c in nx.strongly_connected_components(graph(edges)) if len(c) > 1), key=len, reverse=True
    )


def summary(root: Path = ROOT) -> dict:
    files, found = imports(root)
    executed = [e for e in found if not e.type_only]
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in files.items()), reverse=True)
    # Every import statement of the package (not only those of mmpipe modules), for the share of local ones.
    statements = local = 0
    for path in files.values():
        v = _StatementCounter()
        v.visit(ast.parse(path.read_text()))
        statements += v.total
        local += v.local
    return {
        "modules": len(files),
        "import_statements": statements,
        "function_local_import_statements": local,
        "internal_edges": graph(found).number_of_edges(),
        "function_local_internal_imports": sum(e.local for e in executed),
        "cycles": [len(c) for c in cycles(found)],
        "modules_in_cycles": sum(len(c) for c in cycles(found)),
        "largest_modules": [f"{m} {n}" for n, m in sizes[:8]],
    }


@dataclasses.dataclass(frozen=True)
class LocalImport:
    path: str  # file, relative to the repository root
    line: int
    text: str
    reason: str  # the comment that says why it is inside a function ("" if none)


def local_imports(root: Path = ROOT) -> list[LocalImport]:
    """Every import statement inside a function, with its reason: a comment on its line, on the
    line above it, or on another import of the same run of consecutive import lines."""
    out: list[LocalImport] = []
    for path in module_files(root).values():
        lines = path.read_text().splitlines()
        counter = _StatementCounter()
        counter.visit(ast.parse("\n".join(lines)))
        for node in counter.local_nodes:
            first, last = node.lineno, node.end_lineno or node.lineno
            # the run of import statements around this one, and the comment line just above the run
            lo, hi = first, last
            while lo > 1 and lines[lo - 2].strip().startswith(("import ", "from ", "#")):
                lo -= 1
            while hi < len(lines) and lines[hi].strip().startswith(("import ", "from ")):
                hi += 1
            comments = [ln.split("#", 1)[1].strip() for ln in lines[lo - 1 : hi] if "#" in ln]
            text = " ".join(ln.strip() for ln in lines[first - 1 : last])
            out.append(
                LocalImport(
                    str(path.relative_to(root)), first, text, "; ".join(dict.fromkeys(c for c in comments if c))
                )
            )
    return out


class _StatementCounter(ast.NodeVisitor):
    def __init__(self) -> None:
        self.depth = self.total = self.local = 0
        self.local_nodes: list[ast.Import | ast.ImportFrom] = []

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.total += 1
        self.local += self.depth > 0
        if self.depth > 0:
            self.local_nodes.append(node)

    visit_Import = visit_ImportFrom = _import


if __name__ == "__main__":
    if "--local" in sys.argv:
        for li in local_imports():
            print(f"{li.path}:{li.line}: {li.text}  # {li.reason or 'NO REASON'}")
    if "--cycles" in sys.argv:
        for c in cycles(imports()[1]):
            print(len(c), " ".join(c))
    print(json.dumps(summary(), indent=1))
