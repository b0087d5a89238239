"""The import rules of trajbus's product code, read from the source with ``ast`` (nothing is imported).

Layers, an arrow meaning "may be imported by"::

    infra <- streams.wire <- streams.client <- streams.worker <- {gateway, consumers} <- pipelines <- trajbus

A module imports its own layer and the layers to its left; ``gateway`` and ``consumers`` never import
each other. The contract aliases sit with what they re-export: ``streams.records`` with ``streams.wire``,
``streams.producer`` with ``streams.client``; the ``streams`` package itself (a docstring) with the wire.
The ``trajbus`` package (the lazy exports of the contract) is the top.

``streams.wire`` imports only the standard library, the few third-party libraries in ``WIRE_THIRD_PARTY``
(its codecs, and the prefix encoder's bounded memory) and itself: no Kafka, no infra; a reader in another
language needs nothing else (docs/wire-format.md).

No import cycle among product modules. An import is counted wherever it is written, in a function too,
as ``import a.b``, ``from a import b`` (an edge to the submodule ``a.b`` when there is one, else to ``a``)
and relative forms. A package's ``__init__`` that Python runs before a submodule is not an edge: every
module would then form a cycle with its package. An import under ``if TYPE_CHECKING:`` is counted for the
layers (a type from an upper layer is still a dependency on it) but not for cycles: it never runs, so it
cannot cycle, and breaking a cycle of annotations is what it is for. Names imported through strings
(``lazy_exports``, ``import_dotted``) are not imports here.

A failure names each offending import as ``file:line``; a cycle, each of its edges.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Iterable, Mapping

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("infra", "streams", "gateway", "consumers", "pipelines")

LAYERS = {
    "trajbus.infra": ("infra", 0),
    "trajbus.streams": ("streams.wire", 1),
    "trajbus.streams.wire": ("streams.wire", 1),
    "trajbus.streams.records": ("streams.wire", 1),
    "trajbus.streams.client": ("streams.client", 2),
    "trajbus.streams.producer": ("streams.client", 2),
    "trajbus.streams.worker": ("streams.worker", 3),
    "trajbus.gateway": ("gateway", 4),
    "trajbus.consumers": ("consumers", 4),
    "trajbus.pipelines": ("pipelines", 5),
    "trajbus": ("trajbus", 6),
}
"""A module's layer is that of the longest name here that is it or a package above it: (name, rank)."""

WIRE_THIRD_PARTY = frozenset({
    "numpy",  # token ids as arrays: codec.py, prefix.py, versions.py
    "orjson",  # the JSON of ledger and trained-log records: ledger.py, trained.py
    "cachetools",  # the prefix encoder's memory, bounded by bytes (prefix.py): in-process, no I/O
})


@dataclass(frozen=True)
class Import:
    """One imported module, where it is written."""

    importer: str
    path: str
    line: int
    imported: str
    type_checking: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}"


def discover(root: Path) -> dict[str, Path]:
    """The product modules under ``root`` by their installed names (``trajbus.infra.x`` is ``infra/x.py``)."""
    modules: dict[str, Path] = {}
    for folder in PRODUCT:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join(("trajbus", *parts))] = path
    if (root / "trajbus" / "__init__.py").is_file():
        modules["trajbus"] = root / "trajbus" / "__init__.py"
    return modules


def _guarded(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside an ``if TYPE_CHECKING:`` body."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
            guarded |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    return guarded


def _base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from X import ...``, relative forms resolved against ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    anchor = parts[:len(parts) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def imports_of(module: str, path: Path, root: Path, known: set[str]) -> list[Import]:
    """Every import statement of one module, each imported module resolved to its absolute name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    guarded, where = _guarded(tree), str(path.relative_to(root))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, package)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found += [Import(module, where, node.lineno, name, id(node) in guarded) for name in dict.fromkeys(names)]
    return found


def scan(root: Path) -> list[Import]:
    """The imports of every product module under ``root``, by file and line."""
    modules = discover(root)
    found = [each for module, path in modules.items() for each in imports_of(module, path, root, set(modules))]
    return sorted(found, key=lambda i: (i.path, i.line, i.imported))


@cache
def product_imports() -> tuple[Import, ...]:
    return tuple(scan(ROOT))


def layer(module: str) -> tuple[str, int] | None:
    """``module``'s (layer, rank); None for a module outside trajbus."""
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    return None


def layer_violations(imports: Iterable[Import]) -> list[str]:
    """Imports of a layer to the importer's right, or of the sibling beside it (gateway, consumers)."""
    found = []
    for each in imports:
        (mine, rank), theirs = layer(each.importer), layer(each.imported)
        if theirs is not None and theirs[0] != mine and theirs[1] >= rank:
            found.append(f"{each} (layer {mine} may not import layer {theirs[0]})")
    return found


def wire_violations(imports: Iterable[Import]) -> list[str]:
    """Imports by a wire module of anything but the standard library, the codecs and the wire."""
    wire = ("streams.wire", 1)
    found = []
    for each in imports:
        top = each.imported.partition(".")[0]
        if layer(each.importer) == wire and layer(each.imported) != wire and \
                top not in sys.stdlib_module_names and top not in WIRE_THIRD_PARTY:
            found.append(f"{each} (the wire imports only the standard library, {', '.join(sorted(WIRE_THIRD_PARTY))}"
                         " and itself)")
    return found


COMPOSER = "trajbus.gateway.service"
ABOVE_THE_COMPOSER = ("trajbus.gateway.routes", "trajbus.gateway.app", "trajbus.gateway.server")
"""The gateway's composer builds its parts: only the HTTP surface and the process it serves take it whole."""


def composer_violations(imports: Iterable[Import]) -> list[str]:
    """Imports of the gateway's composer by a part it composes."""
    return [f"{each} (a part the composer builds may not import it)" for each in imports
            if each.imported == COMPOSER and not each.importer.startswith(ABOVE_THE_COMPOSER)
            and each.importer.startswith("trajbus.gateway.")]


def _graph(imports: Iterable[Import], modules: set[str]) -> dict[str, dict[str, Import]]:
    """module -> {imported module: its first import} over the imports that run, between product modules."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for each in imports:
        if not each.type_checking and each.imported in modules and each.imported != each.importer:
            graph[each.importer].setdefault(each.imported, each)
    return graph


def _components(graph: Mapping[str, Mapping[str, Import]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _shortest_cycle(graph: Mapping[str, Mapping[str, Import]], start: str, within: set[str]) -> list[Import]:
    """The edges of a shortest cycle through ``start`` inside one component (breadth first)."""
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, edge in sorted(graph[node].items()):
                if nxt == start:
                    return [*paths[node], edge]
                if nxt in within and nxt not in paths:
                    paths[nxt] = [*paths[node], edge]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start}: no cycle in its component")


def cycles(imports: Iterable[Import], modules: Iterable[str]) -> list[str]:
    """One cycle per set of modules that import each other, each edge as ``file:line``."""
    graph = _graph(imports, set(modules))
    return [" -> ".join(str(edge) for edge in _shortest_cycle(graph, component[0], set(component)))
            for component in _components(graph)]


def _lines(violations: list[str]) -> str:
    return "\n" + "\n".join(violations)


# -- the product ------------------------------------------------------------------------------------------

def test_the_scan_sees_the_product():
    assert {"trajbus", "trajbus.infra.tracing", "trajbus.streams.wire.records", "trajbus.gateway",
            "trajbus.consumers.batch_consumer", "trajbus.pipelines.cli"} <= set(discover(ROOT))
    assert any(each.path == "trajbus/__init__.py" and each.imported == "trajbus.infra.lazy"
               for each in product_imports())


def test_each_layer_imports_only_itself_and_the_layers_below():
    violations = layer_violations(product_imports())
    assert not violations, _lines(violations)


def test_the_wire_imports_only_the_standard_library_its_codecs_and_itself():
    violations = wire_violations(product_imports())
    assert not violations, _lines(violations)


def test_no_gateway_part_imports_its_composer():
    violations = composer_violations(product_imports())
    assert not violations, _lines(violations)


def test_no_import_cycle():
    found = cycles(product_imports(), discover(ROOT))
    assert not found, _lines(found)


# -- the checker, on made-up modules ----------------------------------------------------------------------

def _tree(root: Path, files: Mapping[str, str]) -> list[Import]:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return scan(root)


def test_an_upward_import_is_named_by_file_line_and_module(tmp_path):
    imports = _tree(tmp_path, {
        "infra/__init__.py": "",
        "infra/base.py": "import os\n\n\ndef later():\n    from trajbus.pipelines.cli import main\n",
        "pipelines/__init__.py": "",
        "pipelines/cli.py": "from trajbus.infra import base\n",
        "gateway/app.py": "from ..consumers import rows\n",
        "consumers/rows.py": "",
    })
    assert layer_violations(imports) == [
        "gateway/app.py:1: trajbus.gateway.app imports trajbus.consumers.rows "
        "(layer gateway may not import layer consumers)",
        "infra/base.py:5: trajbus.infra.base imports trajbus.pipelines.cli "
        "(layer infra may not import layer pipelines)",
    ]


def test_a_part_that_imports_the_composer_is_named(tmp_path):
    imports = _tree(tmp_path, {
        "gateway/service.py": "",
        "gateway/chat/completions.py": "from trajbus.gateway.service import GatewayService\n",
        "gateway/routes/chat.py": "from trajbus.gateway.service import GatewayService\n",
    })
    assert composer_violations(imports) == [
        "gateway/chat/completions.py:1: trajbus.gateway.chat.completions imports trajbus.gateway.service "
        "(a part the composer builds may not import it)"]


def test_a_type_checking_import_counts_for_the_layers_not_for_cycles(tmp_path):
    imports = _tree(tmp_path, {
        "streams/wire/records.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from trajbus.streams.client.producer import StepProducer\n",
        "streams/client/producer.py": "from trajbus.streams.wire.records import Step\n",
    })
    assert [v.partition(" (")[0] for v in layer_violations(imports)] == [
        "streams/wire/records.py:3: trajbus.streams.wire.records imports trajbus.streams.client.producer"]
    assert cycles(imports, discover(tmp_path)) == []


def test_the_wire_may_not_import_kafka_or_infra(tmp_path):
    imports = _tree(tmp_path, {
        "streams/wire/chunks.py": "import zlib\nimport numpy as np\nfrom confluent_kafka import Consumer\n"
                                  "from trajbus.infra.clients import reader\nfrom . import codec\n",
        "streams/wire/codec.py": "",
        "infra/clients.py": "",
    })
    assert [v.partition(" (")[0] for v in wire_violations(imports)] == [
        "streams/wire/chunks.py:3: trajbus.streams.wire.chunks imports confluent_kafka",
        "streams/wire/chunks.py:4: trajbus.streams.wire.chunks imports trajbus.infra.clients"]


def test_a_cycle_is_named_edge_by_edge_through_function_and_relative_imports(tmp_path):
    imports = _tree(tmp_path, {
        "infra/__init__.py": "",
        "infra/tracing.py": "X = 1\n\n\ndef exporter():\n    from trajbus.infra import export\n",
        "infra/export.py": '"""Doc."""\n\nfrom .tracing import X\n',
        "infra/alone.py": "from trajbus.infra.tracing import X\n",
    })
    assert cycles(imports, discover(tmp_path)) == [
        "infra/export.py:3: trajbus.infra.export imports trajbus.infra.tracing -> "
        "infra/tracing.py:5: trajbus.infra.tracing imports trajbus.infra.export"]
