"""Walk pagoda's imports (ast, nothing is imported) and report what the layering forbids:

- cycles: groups of modules that import each other, directly or around a loop (function-level imports count:
  they are the same dependency, paid later);
- upward imports: a module of a lower layer (LOWER) importing pagoda.engine or pagoda.entrypoints.

Package __init__ modules are left out: importing pagoda.a.b runs them, but that is Python's, not a dependency.
Exit status 1 where anything is reported.  Usage: python scripts/check_imports.py [--all]
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "pagoda"
LOWER = ("core", "executor", "kernels", "layers", "model", "spec_decode", "structured")
UPPER = ("pagoda.engine", "pagoda.entrypoints")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The pagoda module `name` refers to (a name inside a module resolves to the module); None outside pagoda."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(mod: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The pagoda modules `mod` imports, each with the line of its first import."""
    found: dict[str, int] = {}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if not t.startswith(PACKAGE):
                continue
            target = resolve(t, known)
            if target and target != mod and not known[target].name == "__init__.py":
                found.setdefault(target, node.lineno)
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> int:
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items() if p.name != "__init__.py"}
    problems = 0
    for comp in cycles(graph):
        problems += 1
        print("cycle:", " <-> ".join(comp))
        for a in comp:
            for b, line in graph[a].items():
                if b in comp:
                    print(f"    {known[a].relative_to(ROOT)}:{line} imports {b}")
    lower = tuple(f"{PACKAGE}.{layer}" for layer in LOWER)
    for m, deps in sorted(graph.items()):
        if not m.startswith(lower):
            continue
        for dep, line in deps.items():
            if dep.startswith(UPPER):
                problems += 1
                print(f"upward: {known[m].relative_to(ROOT)}:{line} imports {dep}")
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
