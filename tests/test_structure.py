"""The package's shape, read from the source (no import runs): every module imports only downward
(no cycle in the graph of module-level imports inside minikv/), and no readable policy module
imports a fast form (`*_fast.py`): the reader finds the paper first, and the package plugs the
fast forms in (icecache/__init__.py, softfreeze/__init__.py)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minikv"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imported(name: str, node: ast.AST) -> list[str]:
    """The minikv modules an import statement of module `name` names (for `from x import y`, x
    and, where y is a submodule, x.y)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = name if is_package(name) else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    if len(submodules) == len(node.names):  # `from . import a, b`: only the submodules are read
        return submodules
    return ([base] if base in MODULES else []) + submodules


def module_level(tree: ast.Module):
    """The statements that run when the module is imported: the top level and class bodies,
    into if/try blocks, not into functions or `if TYPE_CHECKING:`."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo += getattr(node, field, [])


def edges(everywhere: bool = False) -> dict[str, set[str]]:
    """module -> the minikv modules it imports at module level (everywhere: in functions too)."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = ast.walk(tree) if everywhere else module_level(tree)
        graph[name] = {m for node in nodes for m in imported(name, node) if m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each back edge closes one)."""
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_the_import_graph_sees_the_package():
    graph = edges()
    assert "minikv.policies.icecache.tree" in graph["minikv.policies.icecache.policy"]
    assert "minikv.policies.icecache.pages_fast" in graph["minikv.policies.icecache"]  # `from . import x`
    assert "minikv.policies.base" in graph["minikv.policies.softfreeze.policy"]  # `from ..base import`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_inside_minikv():
    assert cycles(edges()) == []


def test_no_readable_policy_module_imports_a_fast_form():
    """Anywhere in the module, functions included: policies/*, but the fast forms themselves and
    the packages' __init__.py, which plug them in."""
    graph = edges(everywhere=True)
    readable = [m for m, p in MODULES.items() if m.startswith("minikv.policies.")
                and not p.stem.endswith("_fast") and p.name != "__init__.py"]
    assert len(readable) > 15
    wrong = {m: sorted(n for n in graph[m] if n.endswith("_fast")) for m in readable}
    assert {m: n for m, n in wrong.items() if n} == {}
