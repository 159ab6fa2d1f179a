"""The toolkit's import graph has no cycle, and the model's building blocks stay in toolkit/blocks.

Every module under toolkit/ is read with `ast`, nothing imported, so this is fast and also sees the
modules whose imports need a GPU. The graph has an edge A -> B for each import of toolkit module B
anywhere in A: at module level, inside a function, under `if TYPE_CHECKING`. Function-level imports
count: they defer an import, the dependence is the same, and a cycle through one holds only until
somebody moves that import to the top. Beside the written imports, two that Python makes:
- importing toolkit.a.b first runs toolkit/a/__init__.py, so an importer outside package toolkit.a
  depends on toolkit.a too (inside it, the package is already being imported);
- a package whose __init__ walks `pkgutil.iter_modules(__path__)` (toolkit.families: a family is
  whatever module defines one) imports each of its modules.

The test reads the toolkit the interpreter imports: a copy of this file run outside any checkout with
`PYTHONPATH=<a checkout>` checks that checkout (inside one, pytest puts its root first on sys.path).
"""

from __future__ import annotations

import ast
from pathlib import Path

import toolkit

TOOLKIT = Path(toolkit.__file__).resolve().parent

# Where the modules of the model's building blocks, once at the top of toolkit/ (one in runtime/), went; and
# the split kinds, whose two modules imported each other.
MOVED_OUT = {
    "layers.py": "blocks/ (decoder_spec.py, norms.py, linears.py, attention_self.py, moe_layers.py, ...)",
    "sdpa_attention.py": "blocks/attention_sdpa.py",
    "mla_attention.py": "blocks/attention_mla.py",
    "context_parallel.py": "blocks/context_parallel.py",
    "moe_aux.py": "blocks/router_losses.py",
    "yarn.py": "blocks/rope_yarn.py",
    "longrope.py": "blocks/rope_longrope.py",
    "runtime/gated_delta_rule.py": "blocks/kernels/gated_delta_rule.py",
    "splits.py": "splits/ (kinds.py; Split in __init__.py)",
    "gated_delta_splits.py": "splits/gated_delta.py",
}
# What the blocks may import, all the way down: each other, the families' declarations and split kinds, the
# runtime's compatibility patches, the errors; never the model builder, the trainer, the converter or the CLI.
BLOCKS_DEPEND_ON = ("toolkit.blocks", "toolkit.families", "toolkit.splits", "toolkit.runtime", "toolkit.errors")


def module_name(path: Path) -> str:
    parts = path.relative_to(TOOLKIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(TOOLKIT.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module `from <node.module> import ...` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    package = package if is_package else package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The toolkit modules `name` (at `path`) imports: those it names, their packages, what pkgutil walks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_package)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known.keys()
            named.update(submodules)
            if len(submodules) < len(node.names):  # a name defined in `base` itself (its __init__, for a package)
                named.add(base)
    out = set()
    for target in (t for t in named if t in known):
        parts = target.split(".")
        for depth in range(2, len(parts) + 1):  # toolkit.a, toolkit.a.b, ...: `toolkit` itself imports nothing
            ancestor = ".".join(parts[:depth])
            inside = name == ancestor or name.startswith(ancestor + ".")
            if ancestor in known and (ancestor == target or not inside):  # toolkit.train: no __init__ to run
                out.add(ancestor)
    if is_package and "pkgutil.iter_modules(__path__)" in ast.unparse(tree):
        out.update(m for m in known if m.rpartition(".")[0] == name)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first repeated at the end) per strongly connected
    component of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest way back to the component's first module (breadth first, inside the component)."""
    start = min(component)
    came_from, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")


def test_cycle_finder_names_the_cycle():
    """The finder itself, on a graph with a known cycle beside an acyclic part."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_and_package_imports():
    graph = import_graph()
    assert "toolkit.families.spec" in graph["toolkit.layouts"]  # module level
    assert "toolkit.convert.to_megatron" in graph["toolkit.convert"]  # inside a function of the package
    assert "toolkit.families" in graph["toolkit.layouts"]  # the package of a module it imports
    assert "toolkit.families.llama" in graph["toolkit.families"]  # walked by pkgutil


def test_toolkit_imports_have_no_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in toolkit/ (each: a module, what it imports, ... back to the first):\n" + \
        "\n".join(" -> ".join(cycle) for cycle in found)


def test_building_blocks_live_in_toolkit_blocks():
    """The blocks moved out of the top of toolkit/ stay out of it, beside the commands and entry points."""
    back = {f"toolkit/{name}": f"toolkit/{home}" for name, home in MOVED_OUT.items() if (TOOLKIT / name).is_file()}
    assert not back, f"back at their old paths (module: where it belongs): {back}"


def test_every_block_module_is_in_the_package_table():
    """toolkit/blocks/__init__.py's table says what each module is and where a new kind goes: none missing."""
    table = ast.get_docstring(ast.parse((TOOLKIT / "blocks" / "__init__.py").read_text()))
    blocks = TOOLKIT / "blocks"
    names = {p.name for p in blocks.glob("*.py") if p.name != "__init__.py"} | \
        {f"{p.name}/" for p in blocks.iterdir() if (p / "__init__.py").is_file()}
    assert names and not {n for n in names if f"    {n} " not in table}, \
        f"not in toolkit/blocks/__init__.py's table: {sorted(n for n in names if f'    {n} ' not in table)}"


def test_blocks_import_no_builder_trainer_or_converter():
    graph = import_graph()
    below = set()
    todo = [m for m in graph if m.startswith("toolkit.blocks")]
    while todo:
        for child in graph[todo.pop()] - below:
            below.add(child)
            todo.append(child)
    outside = sorted(m for m in below if not m.startswith(BLOCKS_DEPEND_ON))
    assert not outside, f"toolkit/blocks imports (directly or not) {outside}; it may import only {BLOCKS_DEPEND_ON}"
