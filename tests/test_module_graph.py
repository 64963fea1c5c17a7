"""The shape of the code: activator's modules import each other without a cycle, each
package imports only the packages below it (``LAYERS``), the core imports nothing of the
shell, and no module reaches into a library's private names.

The import graph is read from the source (``ast``), so a late import inside a function
counts as much as one at the top: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "activator"
#: Libraries whose private (underscore) names activator must not use.
NO_PRIVATE_NAMES_FROM = ("gevent", "geventhttpclient", "falcon", "statsd", "httptools", "h2", "prometheus_client")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """Every (module, names) this file imports, relative imports resolved."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names]))
    return found


def graph() -> dict[str, set[str]]:
    """activator module -> the activator modules it imports."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, names in imports_of(path):
            # ``from . import a, b`` imports the modules a and b; ``from .a import x, y``
            # imports the module a (x and y are its names).
            submodules = {f"{target}.{n}" for n in names} & modules.keys()
            found_modules = submodules or ({target} & modules.keys())
            edges[name] |= found_modules - {name}
    return edges


#: The packages from the bottom up: each may import only those before it (and itself).
#: ``front``, ``pods`` and ``ops`` stand side by side: none of them imports another.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"core", ""}),  # and the package's own __init__: its version, nothing else
    frozenset({"base"}),
    frozenset({"front", "pods", "ops"}),
    frozenset({"fleet"}),
    frozenset({"proxy"}),
    frozenset({"process"}),
    frozenset({"cli", "__main__"}),  # the command line
)


def package_of(module: str) -> str:
    """``activator.front.http1`` -> ``front``; ``activator.cli`` -> ``cli``; ``activator`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(package: str) -> int:
    return next(index for index, layer in enumerate(LAYERS) if package in layer)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path that starts and ends on the same module, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(edges[node]):
            if state.get(child) == 1:
                return [*path[path.index(child) :], child]
            if child not in state:
                cycle = visit(child)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_activator_has_no_import_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_graph_reads_every_module_of_one_import() -> None:
    edges = graph()
    # proxy/responder.py: ``from .tunnel import Tunnel`` and base modules by name
    assert {"activator.proxy.tunnel", "activator.base.gate"} <= edges["activator.proxy.responder"]


def test_every_module_lives_in_a_known_package() -> None:
    unknown = sorted(name for name in graph() if not any(package_of(name) in layer for layer in LAYERS))
    assert not unknown, f"modules outside the layers of LAYERS: {unknown}"


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """The imports of ``edges`` that go up a layer or sideways into another package."""
    wrong = []
    for name, targets in edges.items():
        own = layer_of(package_of(name))
        for target in targets:
            theirs = layer_of(package_of(target))
            sideways = theirs == own and package_of(target) != package_of(name) and own != len(LAYERS) - 1
            if theirs > own or sideways:
                wrong.append(f"{name} -> {target}")
    return sorted(wrong)


def test_each_package_imports_only_the_layers_below_it() -> None:
    wrong = layer_violations(graph())
    assert not wrong, "imports against the layers: " + ", ".join(wrong)


def test_the_layer_rule_catches_upward_and_sideways_imports() -> None:
    assert layer_violations({"activator.base.gate": {"activator.proxy.responder"}}) == [
        "activator.base.gate -> activator.proxy.responder"
    ]
    assert layer_violations({"activator.front.http1": {"activator.pods.http1"}}) == [
        "activator.front.http1 -> activator.pods.http1"
    ]
    assert layer_violations({"activator.proxy.responder": {"activator.base.gate", "activator.core.http"}}) == []


def test_the_core_imports_only_the_core() -> None:
    edges = graph()
    for name, targets in edges.items():
        if name.startswith("activator.core"):
            outside = sorted(t for t in targets if not t.startswith("activator.core"))
            assert not outside, f"{name} imports the shell: {outside}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_names_of_libraries(path: Path) -> None:
    for target, names in imports_of(path):
        root = target.split(".")[0]
        if root not in NO_PRIVATE_NAMES_FROM:
            continue
        private = [part for part in target.split(".") if part.startswith("_")]
        private += [name for name in names if name.startswith("_")]
        assert not private, f"{path.name} imports private names of {root}: {target} {names}"
