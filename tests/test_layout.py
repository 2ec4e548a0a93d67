"""The package's folders are layers and imports point down only.

core (pure numpy / torch maths) <- runtime (talks to ranks, hooks models) <- integrations (Trainer,
Accelerate, TRL) <- apps (cli, demo, simulator). `config` is the one configuration object every
layer may read; `testing` (tiny models, synthetic data, rank spawner) may use anything below apps.
Read from the source with `ast`, so a lazy import inside a function counts too.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_dp_balance"
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
