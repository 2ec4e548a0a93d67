import os
import types

import pytest

# Several test processes share two cores: one BLAS / torch thread each keeps timings honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A test is in the `dist` lane when it starts processes or builds a Trainer: `pytest -m "not dist"` is the
# quick lane (pure functions and single-process models). Found from the names the test's code uses, and
# those of the module-level helpers it calls, so no test has to remember a marker (`@pytest.mark.dist`
# still marks one by hand).
_DIST_NAMES = frozenset({"run_ranks", "run_ranks_allow_failures", "run_groups", "subprocess", "torchrun",
                         "Trainer", "SFTTrainer", "run_demo"})


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _uses_processes(function, module, seen=None) -> bool:
    seen = set() if seen is None else seen
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    for name in _names(code):
        if name in _DIST_NAMES:
            return True
        helper = getattr(module, name, None)
        if isinstance(helper, types.FunctionType) and helper.__module__ == module.__name__:
            if _uses_processes(helper, module, seen):
                return True
    return False



def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        fixtures = [d.func for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values() for d in defs]
        if any(_uses_processes(getattr(f, "__wrapped__", f), item.module) for f in [function] + fixtures):
            item.add_marker(pytest.mark.dist)
