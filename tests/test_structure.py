"""The package's shape, read from the source (no import runs). What a reader opens is what runs:
every module imports only downward (no cycle in the graph of imports inside minikv/, those under
`if TYPE_CHECKING:` included; no arrow from a lower layer to a higher one); a fast form
(`*_fast.py`) is imported where it is used, by the policy module that picks the form by backend
or the dispatch module beside it (dispatch.py, which it asks), or by another fast form, never
from a package `__init__` and never by the modules that hold the paper's steps; no package `__init__` changes a class of another module; the model writes no
state of a policy (it calls the contract, the policy keeps its own state)."""
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
    """The statements that run when the module is imported, and those under `if TYPE_CHECKING:`
    (an import for the type checker is an arrow a reader follows): the top level and class
    bodies, into if/try blocks, not into functions."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
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
    assert "minikv.policies.full" in graph["minikv.policies"]  # `from . import x`
    assert "minikv.policies.contract" in graph["minikv.policies.softfreeze.policy"]  # `from ..contract import`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    typing_only = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\n")
    assert [type(n).__name__ for n in module_level(typing_only)].count("Import") == 1


def test_no_import_cycle_inside_minikv():
    assert cycles(edges()) == []


# The layers, lowest first: a module imports (anywhere, functions included) only from its own
# layer or a lower one. The commands (`__main__` modules) sit above everything. Modules of
# minikv/ not named here (loading, fast, tokenizer, plugins, ...) are not ranked.
LAYERS = [("config", "kernels"), ("models",), ("policies",), ("generate",), ("testing", "hf", "cli"), ("bench",)]


def layer_of(module: str) -> int | None:
    if module.endswith(".__main__"):
        return len(LAYERS)
    top = module.split(".")[1] if "." in module else None
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, n) for m, ns in graph.items() for n in ns
                  if layer_of(m) is not None and layer_of(n) is not None and layer_of(n) > layer_of(m))


def test_no_arrow_runs_up():
    assert upward({"minikv.models.x": {"minikv.policies.y"}, "minikv.generate.__main__": {"minikv.cli"}}) == [
        ("minikv.models.x", "minikv.policies.y")]
    assert upward(edges(everywhere=True)) == []


def registers_a_policy(path: Path) -> bool:
    """The module defines a class decorated with `register` (a policy: it picks its forms)."""
    return any(isinstance(node, ast.ClassDef) and any("register" in ast.unparse(d) for d in node.decorator_list)
               for node in ast.walk(ast.parse(path.read_text())))


def test_a_fast_form_is_imported_where_it_is_used():
    """Anywhere in the module, functions included: only a policy module or the dispatch module
    beside it (which pick the form by backend) and the fast forms import a fast form; the modules
    that hold the paper's steps (schedule.py, search.py, tree.py, recovery.py, ...) and the
    packages' __init__.py do not."""
    graph = edges(everywhere=True)
    policies = [m for m in MODULES if m.startswith("minikv.policies")]
    pickers = {m for m in policies if registers_a_policy(MODULES[m]) or m.endswith(".dispatch")}
    assert {"minikv.policies.softfreeze.dispatch", "minikv.policies.icecache.policy"} <= pickers
    # softfreeze's policy module holds the paper's rule: its forms come through dispatch.py
    assert [n for n in graph["minikv.policies.softfreeze.policy"] if n.endswith("_fast")] == []
    assert "minikv.policies.softfreeze.schedule" not in pickers and "minikv.policies" not in pickers
    wrong = {m: sorted(n for n in graph[m] if n.endswith("_fast")) for m in policies
             if m not in pickers and not m.endswith("_fast")}
    assert {m: n for m, n in wrong.items() if n} == {}


def assigned_attributes(nodes) -> list[ast.Attribute]:
    """The attribute targets of the assignments among `nodes` (a.b = ..., a.b += ..., a.b: T = ...)
    and of their setattr(a, ...) calls, as the nodes they assign to (setattr's: `a.?`)."""
    found = []
    for node in nodes:
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            found += [t for t in ast.walk(target) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            found.append(ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store()))
    return found


def test_no_package_init_changes_another_module():
    """A package __init__ imports and lists names; setting an attribute there would change a
    class or module the reader opens elsewhere (a fast form plugged in from outside)."""
    def plugged(source: str) -> list[str]:  # what the module's import-time statements assign to
        return [ast.unparse(a) for a in assigned_attributes(module_level(ast.parse(source)))]

    assert plugged("from .policy import P\nfrom . import fast\nP.search = fast.search\n"
                   "def f(self):\n    self.x = 1\n") == ["P.search"]
    inits = [p for p in MODULES.values() if p.name == "__init__.py"]
    assert len(inits) > 10
    wrong = {str(p.relative_to(ROOT)): plugged(p.read_text()) for p in inits}
    assert {p: a for p, a in wrong.items() if a} == {}


POLICY_NAMES = {"policy", "layer_kv"}  # what the model calls the policy and a policy's layer


def writes_policy_state(source: str) -> list[str]:
    """Assignments in `source` to an attribute of the policy or of its layer (policy.x = ...,
    policy.a.b += ..., setattr(layer_kv, ...))."""
    out = []
    for target in assigned_attributes(ast.walk(ast.parse(source))):
        root = target
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in POLICY_NAMES:
            out.append(ast.unparse(target))
    return out


def test_the_model_writes_no_policy_state():
    assert writes_policy_state("def f(policy, layer_kv, x):\n    policy.last_action = x\n    layer_kv.a.b += 1\n"
                               "    setattr(policy, 'n', 1)\n    self.rope = x\n") == [
        "policy.last_action", "layer_kv.a.b", "policy.?"]
    models = list((ROOT / "models").rglob("*.py"))
    assert len(models) >= 5
    wrong = {str(p.relative_to(ROOT)): writes_policy_state(p.read_text()) for p in models}
    assert {p: w for p, w in wrong.items() if w} == {}


def test_the_reader_path_follows_the_layout():
    """tools/reader_path.py counts the files the reading guide (docs/reading.md) names, for every
    policy: a file moved or split is renamed in its lists too, and a new policy gets a path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reader_path", ROOT.parent / "tools" / "reader_path.py")
    reader_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader_path)
    listed = set(reader_path.SHARED).union(*reader_path.POLICIES.values())
    assert sorted(p for p in listed if not (ROOT.parent / p).is_file()) == []
    names = {ast.literal_eval(node.value) for m, path in MODULES.items() if registers_a_policy(path)
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Assign)
             and [ast.unparse(t) for t in node.targets] == ["name"] and isinstance(node.value, ast.Constant)}
    assert "freekv" in names and set(reader_path.POLICIES) == names - {"full"}
