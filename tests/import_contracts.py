"""An import-linter contract type of ours: no import cycle between any two modules.

import-linter's `acyclic_siblings` looks at siblings with their descendants squashed together,
a package-level view; this one looks at modules, the unit a reader follows. Every import counts,
those inside functions too: a function-level import hides a cycle from Python's import order,
not from the reader. Named in pyproject.toml's `[tool.importlinter]` and run by `lint-imports`
(tests/test_layers.py)."""

from __future__ import annotations

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain.contract import Contract, ContractCheck


def module_cycles(graph: ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each
    sorted; the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
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
                    work.append((child, iter(edges[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


class AcyclicModulesContract(Contract):
    type_name = "acyclic_modules"

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        cycles = []
        for component in module_cycles(graph):
            inside = set(component)
            cycles.append([
                (m, d["imported"], d["line_number"])
                for m in component
                for imported in sorted(graph.find_modules_directly_imported_by(m) & inside)
                for d in graph.get_import_details(importer=m, imported=imported)[:1]])
        return ContractCheck(kept=not cycles, warnings=[], metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for imports in check.metadata["cycles"]:
            modules = sorted({m for m, _, _ in imports})
            output.print(f"An import cycle through {len(modules)} modules ({', '.join(modules)}):")
            output.new_line()
            for importer, imported, line in imports:
                output.indent_cursor()
                output.print(f"- {importer} -> {imported} (l.{line})")
            output.new_line()
