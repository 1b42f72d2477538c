"""Print the imports between Sprout's packages: who imports whom, how often, and any package cycles.

    python ops/import_graph.py            # from a checkout; reads the source, imports nothing

Imports under `if __name__ == "__main__":` (the `python -m` forms, which run the `sprout` command) are
counted apart: they are what a program does when it is started, not what the module depends on.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOT = next(p for p in (REPO / "src" / "sprout", REPO / "sprout") if p.is_dir())


def package_of(module: str) -> str:
    """`sprout.tasks.swe_rebench.grade` -> `tasks`; a top-level module is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(sprout)"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _main_block(node: ast.AST) -> bool:
    """Whether `node` is `if __name__ == "__main__":`."""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                    for c in test.comparators))


def _nodes(tree: ast.AST, *, in_main: bool) -> list[ast.AST]:
    """Every node of `tree` outside (or, with `in_main`, inside) its `if __name__ == "__main__":` blocks."""
    found, todo = [], [(tree, False)]
    while todo:
        node, inside = todo.pop()
        inside = inside or _main_block(node)
        if inside == in_main:
            found.append(node)
        todo += [(child, inside) for child in ast.iter_child_nodes(node)]
    return found


def imported_modules(path: Path, *, in_main: bool = False) -> list[str]:
    me = module_name(path)
    is_package = path.name == "__init__.py"
    found = []
    for node in _nodes(ast.parse(path.read_text(), str(path)), in_main=in_main):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")[: len(me.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(target)
    return [m for m in found if m == "sprout" or m.startswith("sprout.")]


def edges() -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for path in sorted(ROOT.rglob("*.py")):
        source = package_of(module_name(path))
        for target in map(package_of, imported_modules(path)):
            if target != source:
                counts[source, target] += 1
    return counts


def cycles(counts: Counter[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for a, b in counts:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    counts = edges()
    print(f"imports between packages of {ROOT.relative_to(REPO)} (importer -> imported: import statements)")
    for source in sorted({a for a, _ in counts}):
        targets = sorted((b, n) for (a, b), n in counts.items() if a == source)
        print(f"  {source:12} -> " + ", ".join(f"{b} {n}" for b, n in targets))
    programs = sorted(module_name(path) for path in ROOT.rglob("*.py") if imported_modules(path, in_main=True))
    print("run as programs (`python -m`, importing the command line then): " + ", ".join(programs))
    loops = cycles(counts)
    print("package cycles: " + ("; ".join(" <-> ".join(c) for c in loops) if loops else "none"))
    return 1 if loops else 0


if __name__ == "__main__":
    sys.exit(main())
