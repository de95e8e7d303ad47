"""The house rules, checked on the source: floors, no cycles, no borrowed underscore names, sizes."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mixle"

# Each room's floor; a module may import only from its own floor or below. llama.cpp's block numerics
# and format records live in its room but stand on the core's floor: framework-free, imported by
# ``import mixle`` (which registers the formats), and importing nothing of the room above them.
LLAMA_CPP_FORMATS = ("mixle.gguf.formats", "mixle.gguf.ggml_quants", "mixle.gguf.ggml_kquants", "mixle.gguf.ggml_weighted")
FLOORS = (
    (1, ("mixle", "mixle._optional", "mixle.core", *LLAMA_CPP_FORMATS)),
    (2, ("mixle.backends", "mixle.torch_backend", "mixle.flax_backend")),
    (3, ("mixle.api", "mixle.exports", "mixle.gguf", "mixle.task", "mixle.experimental")),
    (4, ("mixle.lm",)),
    (5, ("mixle.models", "mixle.__main__")),
)
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 60


def floor_of(module):
    best = None
    for floor, roots in FLOORS:
        for root in roots:
            if (module == root or module.startswith(root + ".")) and (best is None or len(root) > len(best[1])):
                best = (floor, root)
    return best[0]


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text(), filename=str(path))


def imports_of(name, path, tree):
    """(line, imported module, imported names) for every import of a mixle module, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mixle"):
                    yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target.startswith("mixle"):
                yield node.lineno, target, tuple(alias.name for alias in node.names)


ALL = list(modules())
NAMES = {name for name, _, _ in ALL}


def test_no_import_runs_up_a_floor():
    upward = []
    for name, path, tree in ALL:
        for line, target, names in imports_of(name, path, tree):
            targets = [f"{target}.{n}" for n in names if f"{target}.{n}" in NAMES] or [target]
            for module in targets:
                if floor_of(module) > floor_of(name):
                    upward.append(f"{path.name}:{line} {name} (floor {floor_of(name)}) -> {module} "
                                  f"(floor {floor_of(module)})")
    assert upward == []


def test_no_import_cycle():
    graph = {name: set() for name in NAMES}
    for name, path, tree in ALL:
        for _, target, names in imports_of(name, path, tree):
            for module in [f"{target}.{n}" for n in names if f"{target}.{n}" in NAMES] or [target]:
                if module in NAMES and module != name and not name.startswith(module + "."):
                    graph[name].add(module)
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_core_knows_no_file_format_room():
    # Formats join the core's records by registering (``register_grid``); the core imports none of them.
    found = [f"{name}:{line} -> {target}" for name, path, tree in ALL if name.startswith("mixle.core")
             for line, target, _ in imports_of(name, path, tree) if target.startswith(("mixle.gguf", "mixle.exports"))]
    assert found == []


def test_no_module_borrows_another_modules_underscore_names():
    borrowed = []
    for name, path, tree in ALL:
        aliases = {}
        for line, target, names in imports_of(name, path, tree):
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__"):
                    borrowed.append(f"{name}:{line} from {target} import {imported}")
                aliases[imported] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                for alias in node.names:
                    if alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.value.id in aliases):
                source = aliases[node.value.id]
                if source.startswith("mixle") or f"{source}.{node.value.id}" in NAMES:
                    borrowed.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert borrowed == []


@pytest.mark.parametrize("name, path, tree", ALL, ids=[name for name, _, _ in ALL])
def test_rooms_are_small(name, path, tree):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.name} has {lines} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


@pytest.mark.parametrize("path", sorted(p for suffix in ("*.cpp", "*.h") for p in PACKAGE.rglob(suffix)),
                         ids=lambda path: path.name)
def test_kernel_sources_are_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.name} has {lines} lines"


def test_the_rules_see_a_violation(tmp_path):
    # The checkers above must be able to fail: feed them a module that breaks each rule.
    tree = ast.parse("from mixle.lm.compare import _Run\nimport mixle.torch_backend.layers as layers\nlayers._x\n")
    found = list(imports_of("mixle.core.bad", tmp_path / "bad.py", tree))
    assert [(t, n) for _, t, n in found] == [("mixle.lm.compare", ("_Run",)), ("mixle.torch_backend.layers", ())]
    assert floor_of("mixle.lm.compare") > floor_of("mixle.core.bad")
    assert floor_of("mixle.core.numerics") == 1 and floor_of("mixle.models.qat") == 5
