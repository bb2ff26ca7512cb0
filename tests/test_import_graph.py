"""No import circle anywhere in ``ckptspec``.

The graph is grimp's (import-linter's own builder), which records every ``import`` statement of a
module, the ones inside functions included: a lazy import that closes a circle is a circle all the
same (it only moves the failure from import time to call time). How edges count:

* an edge is an import statement, as written. A package's ``__init__`` importing its children is an
  edge parent -> child; Python importing the parent before a child is not an edge (no statement). So
  a parent that dispatches to its children (``describe/__init__``) is fine, and a child that imports
  its parent's dispatcher back is a circle, which is the rule "kind modules never import a dispatcher".
* imports under ``if TYPE_CHECKING:`` are left out: they never run, and annotations naming each
  other's classes (``location.store`` and its handles) are not a dependency.

A circle fails the test with the modules it runs through.
"""

from __future__ import annotations

import grimp
import pytest


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_lazy_circle():
    """The detector itself: a circle closed by an import inside a function is found."""
    graph = grimp.ImportGraph()
    graph.add_import(importer="pkg.kind", imported="pkg.builder", line_number=3, line_contents="from .builder import B")
    graph.add_import(
        importer="pkg.builder", imported="pkg.kind", line_number=40, line_contents="    from .kind import k"
    )
    graph.add_import(importer="pkg.builder", imported="pkg.names", line_number=4, line_contents="from .names import N")
    assert cycles(graph) == [["pkg.builder", "pkg.kind"]]


@pytest.mark.parametrize("package", ["ckptspec"])
def test_no_import_circle(package):
    graph = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=True)
    found = cycles(graph)
    assert not found, "import circles (function-level imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_deepspeed_imports_no_private_name():
    """A name another module needs is public: no ``_name`` crosses a module border in ``ckptspec/deepspeed``
    (``_Builder``, ``_files_of``, ``_pipeline_view`` and a check's ``_resolve`` did)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "ckptspec" / "deepspeed"
    found = [
        f"{path.relative_to(root)}:{node.lineno} {alias.name}"
        for path in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ckptspec"))
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not found, "private names imported across modules: " + ", ".join(found)
