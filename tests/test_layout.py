"""The package's layout holds in the code (ARCHITECTURE.md): no import circle, deferred imports
included; layers import downward only; the runner's task side never imports its driver side; no
package reaches into another's private modules; no function longer than a screen; no Param read by
name outside the Param table. Part of the fast layer."""
import ast
import pathlib
import re
from typing import Dict, List, Set

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "sparkring"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500  # a file does one job


def _modules() -> Dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> Set[str]:
    """Every sparkring module ``name`` imports anywhere in its body (deferred and TYPE_CHECKING too)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles() -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
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
                components.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return components


def test_no_module_takes_part_in_an_import_circle_deferred_imports_included():
    assert _cycles() == []


@pytest.mark.parametrize("lower, upper", [
    ("sparkring.collective", "sparkring.runner"), ("sparkring.collective", "sparkring.estimator"),
    ("sparkring.collective", "sparkring.data"), ("sparkring.data", "sparkring.runner"),
    ("sparkring.data", "sparkring.estimator"), ("sparkring.data", "sparkring.collective"),
    ("sparkring.runner", "sparkring.estimator"), ("sparkring.runner.task", "sparkring.runner.driver"),
    ("sparkring.trainer", "sparkring.estimator"), ("sparkring.runner", "sparkring.trainer"),
    ("sparkring.data", "sparkring.trainer"), ("sparkring.collective", "sparkring.trainer"),
    ("sparkring.trainer", "sparkring.runner.driver"), ("sparkring.estimator", "sparkring.tune"),
    ("sparkring.trainer", "sparkring.tune"), ("sparkring.runner", "sparkring.tune"),
    ("sparkring.data", "sparkring.tune"), ("sparkring.estimator", "sparkring.spark"),
    ("sparkring.trainer", "sparkring.spark"), ("sparkring.runner", "sparkring.spark"),
    ("sparkring.collective", "sparkring.spark"), ("sparkring.data", "sparkring.spark"),
    ("sparkring.tune", "sparkring.spark"), ("sparkring.spark.torch.losses", "sparkring.estimator"),
    ("sparkring.errors", "sparkring.runner"), ("sparkring.process_start", "sparkring.collective"),
])
def test_a_layer_never_imports_one_above_it(lower, upper):
    wrong = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if m == lower or m.startswith(lower + ".")
                   for t in targets if t == upper or t.startswith(upper + "."))
    assert wrong == []


def test_no_package_imports_another_packages_private_modules():
    def package_of(module: str) -> str:
        path = MODULES[module]
        return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]

    wrong = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                   if t.rsplit(".", 1)[-1].startswith("_") and not t.endswith("__")
                   and not (package_of(m) + ".").startswith(t.rsplit(".", 1)[0] + "."))
    assert wrong == []


def _private_names_imported_across_packages() -> List[str]:
    """``from a.b import _name`` where ``a.b`` is in another package than the importer (not its own or a parent)."""
    def package_of(module: str) -> str:
        return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]

    wrong = []
    for name, path in MODULES.items():
        package = package_of(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base not in MODULES or (package + ".").startswith(package_of(base) + "."):
                continue  # its own package's, or a parent package's (as with private modules)
            wrong += [f"{name} imports {base}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.endswith("__")]
    return sorted(wrong)


def test_no_package_imports_another_packages_private_names():
    assert _private_names_imported_across_packages() == []


def test_no_module_is_longer_than_one_job_needs():
    long = sorted(f"{name}: {n} lines" for name, path in MODULES.items()
                  if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES)
    assert long == []


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


def test_no_param_is_read_by_name_outside_the_param_table():
    """estimator/params.py declares the Params and reads them by name (into EstimatorConfig); the rest of
    the package reads the config's typed fields."""
    by_name = re.compile(r"""getOrDefault\(\s*["']|paramValues\(\)""")
    readers = sorted(f"{name}:{number}" for name, path in MODULES.items() if name != "sparkring.estimator.params"
                     for number, line in enumerate(path.read_text().splitlines(), start=1) if by_name.search(line))
    assert readers == []


TESTS = pathlib.Path(__file__).resolve().parent


def test_helpers_live_in_tests_helpers_beside_the_layers_test_folders():
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py" and not p.name.startswith("test_"))
    assert loose == []


def _sleeps_in_own_body(function: ast.AST) -> List[int]:
    """Lines where ``function`` itself (not a function nested in it) calls time.sleep or sleep."""
    found, todo = [], list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            called = node.func
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")
            if name == "sleep":
                found.append(node.lineno)
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_no_test_sleeps_a_fixed_time_in_its_own_body():
    """A test waits for a condition (waiting.wait_until), never for a guessed number of seconds."""
    sleeping = []
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                sleeping += [f"{path.relative_to(TESTS)}:{line}" for line in _sleeps_in_own_body(node)]
    assert sleeping == []


def _public_functions_of_the_collective_api():
    import inspect

    import sparkring.collective as sr

    return [(name, getattr(sr, name)) for name in sr.__all__ if inspect.isfunction(getattr(sr, name))]


def test_every_public_collective_is_defined_in_a_public_module():
    """Horovod's layout: a reader finds each public name where it is defined (basics, mpi_ops,
    functions, optimizer ...), never in a private module re-exported by __init__."""
    hidden = [f"{name} ({fn.__module__})" for name, fn in _public_functions_of_the_collective_api()
              if fn.__module__.rsplit(".", 1)[-1].startswith("_")]
    assert not hidden, f"public collective names defined in private modules: {hidden}"


def test_every_public_collective_says_its_arguments_and_what_it_returns():
    import inspect

    missing = []
    for name, fn in _public_functions_of_the_collective_api():
        doc = inspect.getdoc(fn) or ""
        if inspect.signature(fn).parameters and "Arguments:" not in doc:
            missing.append(f"{name}: Arguments")
        if "Returns:" not in doc:
            missing.append(f"{name}: Returns")
    assert not missing, f"docstrings without their sections: {missing}"
