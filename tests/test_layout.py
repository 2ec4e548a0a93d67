"""The package's folders are layers and imports point down only.

core (pure numpy / torch maths) <- runtime (talks to ranks, hooks models) <- integrations (Trainer,
Accelerate, TRL) <- apps (cli, demo, simulator). `config` is the one configuration object every
layer may read; `testing` (tiny models, synthetic data, rank spawner) may use anything below apps.
Read from the source with `ast`, so a lazy import inside a function (or under `TYPE_CHECKING`) counts too.
No two modules of the package import each other, directly or through others.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_dp_balance"
TESTS = pathlib.Path(__file__).resolve().parent
LAYERS = ["core", "runtime", "integrations", "apps"]
# what each folder may import from the package besides itself
ALLOWED = {
    "core": set(),
    "runtime": {"core", "config"},
    "integrations": {"core", "runtime", "config"},
    "apps": {"core", "runtime", "integrations", "config", "testing"},
    "testing": {"core", "runtime", "integrations", "config"},
}
# imports core must never make: communication and the Trainer belong to the shell
CORE_FORBIDDEN = ("torch.distributed", "transformers.trainer", "accelerate")
# Import cycles not yet broken (none); each entry must still be a cycle (a stale one fails), so the list only shrinks.
KNOWN_CYCLES: list = []


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; the layers use absolute imports")
            yield node.module or "", node.lineno
            if node.module == "transformers":
                for alias in node.names:
                    if alias.name in ("Trainer", "TrainerCallback", "TrainingArguments"):
                        yield "transformers.trainer", node.lineno


def _package_part(module: str):
    parts = module.split(".")
    return parts[1] if parts[0] == "hf_dp_balance" and len(parts) > 1 else None


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_imports_only_the_layers_below_it(folder):
    offences = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for module, line in _imports(path):
            part = _package_part(module)
            if part is not None and part != folder and part not in ALLOWED[folder]:
                offences.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not offences, "\n".join(offences)


def test_core_imports_no_communication_and_no_trainer():
    offences = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        for module, line in _imports(path):
            if module.startswith(CORE_FORBIDDEN):
                offences.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not offences, "\n".join(offences)


def test_the_checker_sees_an_offence(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from hf_dp_balance.runtime.loader import BalancedLoader\n")
    assert [(m, _package_part(m)) for m, _ in _imports(bad)] == [("hf_dp_balance.runtime.loader", "runtime")]


def test_no_module_is_left_at_the_package_top_but_the_config():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "config.py"]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: pathlib.Path) -> dict:
    """{module: set of modules of the package it imports}, anywhere in its source."""
    paths = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for module, path in paths.items():
        targets = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from pkg import sub` imports the module pkg.sub; `from mod import name` imports mod
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                         for a in node.names]
            else:
                continue
            targets.update(n for n in names if n in paths and n != module)
        graph[module] = targets
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles_between_the_package_s_modules():
    graph = _import_graph(PACKAGE)
    cycles = [c for c in _cycles(graph) if set(c) not in KNOWN_CYCLES]
    assert not cycles, "modules that import each other:\n" + "\n".join(
        f"  {m}: imports {sorted(graph[m] & set(c))}" for c in cycles for m in c)


def test_every_known_cycle_is_still_one():
    # an entry whose cycle was removed must go, or a new cycle over the same modules would pass unseen
    stale = [sorted(known) for known in KNOWN_CYCLES if sorted(known) not in _cycles(_import_graph(PACKAGE))]
    assert not stale, f"no longer cycles, remove from KNOWN_CYCLES: {stale}"


def test_the_cycle_finder_sees_a_lazy_import_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py", "c.py"):
        (package / name).write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("import pkg.c\ndef f():\n    from pkg.a import g\n")
    graph = _import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c", "pkg.a"}
    assert _cycles(graph) == [["pkg.a", "pkg.sub.b"]]


# Helpers under tests/ that tests may still import (none: they live in hf_dp_balance/testing/). Each entry
# must still be imported, so the list can only shrink.
KNOWN_TEST_HELPERS: set = set()


def _imports_of_tests():
    for path in sorted(TESTS.rglob("*.py")):
        for module, line in _imports(path):
            if module == "tests" or module.startswith("tests."):
                yield f"{path.relative_to(TESTS.parent)}:{line}", module


def test_tests_take_their_helpers_from_the_testing_package_not_from_each_other():
    offences = [f"{where} imports {module}" for where, module in _imports_of_tests()
                if module not in KNOWN_TEST_HELPERS]
    assert not offences, "a test's helpers belong in hf_dp_balance/testing/:\n" + "\n".join(offences)


def test_every_known_test_helper_is_still_imported():
    stale = KNOWN_TEST_HELPERS - {module for _, module in _imports_of_tests()}
    assert not stale, f"no longer imported, remove from KNOWN_TEST_HELPERS: {sorted(stale)}"
