"""The import graph: no cycle inside any package (function-level imports included, since they hide
cycles rather than remove them), and imports flow server -> runtime -> scheduler, loader standing alone
(runtime reads sizes with loader.sizes, the project's one size parser)."""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("runtime", "scheduler", "server", "loader")
MAY_IMPORT = {
    "server": {"runtime", "scheduler", "loader"},
    "runtime": {"scheduler", "loader"},
    "scheduler": set(),
    "loader": set(),
}


def modules() -> dict[str, str]:
    """{dotted module name: file path} for every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return found


def imports_of(path: str, name: str, known: set[str]) -> set[str]:
    """The project modules a file imports, anywhere in it (module level or inside functions)."""
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    """Every module's project imports: parsed once for the module's tests (read, never changed)."""
    mods = modules()
    return {name: imports_of(path, name, set(mods)) - {name} for name, path in mods.items()}


def cycles_within(package: str, edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-loop) inside the package."""
    nodes = [n for n in edges if n.split(".")[0] == package]
    inside = {n: {m for m in edges[n] if m.split(".")[0] == package} for n in nodes}
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in inside[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for n in nodes:
        if n not in index:
            visit(n)
    return result


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_the_package(package):
    assert cycles_within(package, graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package):
    edges = graph()
    wrong = sorted(
        f"{a} imports {b}"
        for a, targets in edges.items()
        if a.split(".")[0] == package
        for b in targets
        if b.split(".")[0] not in MAY_IMPORT[package] | {package}
    )
    assert wrong == []


def test_the_walk_sees_a_cycle_when_there_is_one():
    """The checker itself: a cycle hidden in a function body is found."""
    edges = {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert cycles_within("pkg", edges) == [["pkg.a", "pkg.b"]]
    assert "runtime.model.hf_checkpoint" in graph()["runtime.model.checkpoint"]


def folders(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between a package's concept folders (runtime.engine, loader.cache, ...) and its top-level
    modules; the package's own __init__ (its public face, which re-exports) is left out."""

    def room(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2])

    out: dict[str, set[str]] = {}
    for a, targets in edges.items():
        if a in PACKAGES:
            continue
        out.setdefault(room(a), set()).update(room(b) for b in targets if b not in PACKAGES)
    return {a: targets - {a} for a, targets in out.items()}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_the_concept_folders(package):
    """The folders read as the architecture: if runtime.engine imports runtime.model, nothing in
    runtime.model imports runtime.engine (function-level imports included)."""
    assert cycles_within(package, folders(graph())) == []


@pytest.mark.slow
def test_a_cpu_only_server_does_not_import_triton():
    """Triton loads only where CUDA is (or its CPU interpreter is asked for): a CPU server's start-up and
    exit stay free of it."""
    import subprocess
    import sys

    code = (
        "import sys, server.app, runtime.runner.model_runner, runtime.model.model; "
        "print('triton' in sys.modules)"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
