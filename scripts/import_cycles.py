"""Count import cycles: between modules, and between the top-level packages.

    .venv/bin/python scripts/import_cycles.py        # prints 0 and exits 0 when there are none

Every import counts (module level or inside a function) except those under
`if TYPE_CHECKING:`, which never run. A cycle is a strongly connected group of two or more
modules (or packages); each is listed. `make lint` fails on any.
"""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("common", "superinfer", "gateway", "scheduler_svc", "kvmem_svc", "worker", "proto")


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Groups of 2+ nodes that reach each other (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def main() -> int:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in modules}
    top = {m: m.split(".")[0] for m in modules}
    pkg_edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for m, targets in edges.items():
        pkg_edges[top[m]].update(top[t] for t in targets if top[t] != top[m])
    cycles = strongly_connected(modules, edges) + strongly_connected(list(PACKAGES), pkg_edges)
    for group in cycles:
        print("cycle: " + " <-> ".join(group), file=sys.stderr)
    print(len(cycles))
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
