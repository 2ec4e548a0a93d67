"""The planner package's size and shape, read from its source: the counts it is held to, and a package
map (the package docstring, docs/planner.md) that names every module and no other."""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hf_dp_balance" / "core" / "planner"
MAX_LINES = 2500  # all of core/planner/*.py (4,093 before the planner was made one pipeline)
MAX_CONSTANTS = 20
MAX_FUNCTION_LINES = 80


def _modules():
    return {path.stem: path.read_text() for path in sorted(PACKAGE.glob("*.py"))}


def _numeric_constants(source: str):
    """(name, line) of every module-level assignment of a number (or an arithmetic of numbers)."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            numeric = value is not None and all(
                isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
                and (not isinstance(n, ast.Constant) or isinstance(n.value, (int, float)))
                for n in ast.walk(value))
            if numeric:
                found += [(t.id, node.lineno) for t in targets if isinstance(t, ast.Name)]
    return found


def test_the_package_holds_its_line_count():
    total = sum(len(src.splitlines()) for src in _modules().values())
    assert total <= MAX_LINES, total


def test_module_level_numeric_constants_are_few_defined_once_and_each_says_why():
    seen = {}
    for name, src in _modules().items():
        lines = src.splitlines()
        comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(src).readline)
                    if tok.type == tokenize.COMMENT}
        for constant, line in _numeric_constants(src):
            assert constant not in seen, f"{constant} defined in {seen[constant]} and {name}"
            seen[constant] = name
            assert line in comments, f"{name}.py:{line} {constant} has no reason on its line: {lines[line - 1]}"
    assert len(seen) <= MAX_CONSTANTS, sorted(seen)


def test_no_function_is_over_80_lines():
    long = []
    for name, src in _modules().items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append((name, node.name, size))
    assert not long, long


def test_the_package_map_names_every_module_and_no_other():
    modules = set(_modules()) - {"__init__"}
    doc = ast.get_docstring(ast.parse(_modules()["__init__"]))
    in_docstring = set(re.findall(r"^`?(\w+)`?\.py\b|^- `(\w+)`", doc, flags=re.M))
    in_docstring = {a or b for a, b in in_docstring}
    assert in_docstring == modules, (in_docstring ^ modules)
    page = (ROOT / "docs" / "planner.md").read_text()
    table = set(re.findall(r"^\| `(\w+)\.py` \|", page, flags=re.M))
    assert table == modules, (table ^ modules)


def test_the_counting_helpers_see_what_they_count():
    # the constants and function-length readers above on a known source: they must not pass by seeing nothing
    src = "A = 1  # why\nB = 2 ** 4\nC = 'text'\ndef f():\n" + "    x = 1\n" * 90
    assert [c for c, _ in _numeric_constants(src)] == ["A", "B"]
    size = [n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)]
    assert size == [91]
