import multiprocessing.process
import os
import subprocess
import sys
import types

import pytest

from hf_dp_balance.testing import spawn

from hypothesis import settings

# CI runs each property test on its fixed examples: a red CI then means the code changed, not that a new
# random draw was found; exploring new draws is what a local run is for.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

pytest_plugins = ["pytester"]  # tests/test_lanes.py runs a throw-away suite under this file

# Several test processes share two cores: one BLAS / torch thread each keeps timings honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The demo's ranks are quiet too (apps/demo._RANK_ENV): with the same environment as this process they fork
# from the spawner's forkserver (torch already imported) instead of starting afresh.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _calls(function, names, seen=None) -> bool:
    """Whether `function`, or a function it names from its own module or hf_dp_balance.testing, uses one of
    `names` (a name it loads, an attribute it reads, a function it calls)."""
    seen = set() if seen is None else seen
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    scope = getattr(function, "__globals__", {})
    for name in _names(code):
        if name in names:
            return True
        helper = scope.get(name)
        if isinstance(helper, types.FunctionType) and (
                helper.__module__ == function.__module__ or helper.__module__.startswith("hf_dp_balance.testing")):
            if _calls(helper, names, seen):
                return True
    return False


# What starts processes or builds a Trainer. The spawner's functions are found from its source (any that
# reaches `_spawn`), so a new one is in the list without anyone adding it.
SPAWNERS = frozenset(name for name, value in vars(spawn).items() if isinstance(value, types.FunctionType)
                     and not name.startswith("_") and _calls(value, {"_spawn"}))
_DIST_NAMES = SPAWNERS | {"subprocess", "torchrun", "Process", "Popen", "Trainer", "SFTTrainer", "run_demo"}
# Dependency checks: how transformers, torch or DeepSpeed behave, not this library; run with --upstream
# (or a -m expression naming the marker).
UPSTREAM = "upstream"


def pytest_addoption(parser):
    parser.addoption("--upstream", action="store_true",
                     help="also run the tests marked upstream (checks of a dependency, not of hf_dp_balance)")


def _uses_processes(function) -> bool:
    return _calls(getattr(function, "__wrapped__", function), _DIST_NAMES)


# A test is in the `dist` lane when it starts processes or builds a Trainer: `pytest -m "not dist"` is the
# quick lane (pure functions and single-process models). Found from the names the test's code and its
# fixtures use, and those of the helpers they call, so no test has to remember a marker
# (`@pytest.mark.dist` still marks one by hand); a test the names miss fails when it starts a process.
def pytest_collection_modifyitems(config, items):
    for item in items:
        function = getattr(item, "function", None)
        if function is None:
            continue
        fixtures = [d.func for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values() for d in defs]
        if any(_uses_processes(f) for f in [function] + fixtures):
            item.add_marker(pytest.mark.dist)
    if config.getoption("--upstream") or UPSTREAM in (config.getoption("-m") or ""):
        return
    kept = [item for item in items if item.get_closest_marker(UPSTREAM) is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker(UPSTREAM)])
        items[:] = kept


def _is_python_of_this_environment(args) -> bool:
    program = args if isinstance(args, (str, bytes, os.PathLike)) else (list(args) or [""])[0]
    program = os.fsdecode(program).split()[0] if program else ""
    return os.path.dirname(os.path.abspath(program)) == os.path.dirname(sys.executable) or \
        os.path.basename(program).startswith("python")


class _ProcessGuard:
    """While a test outside the dist lane runs, starting a process (multiprocessing, or a Python / torchrun
    of this environment) raises: the quick lane starts none. Tools a dependency runs (fc-list) pass."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def refuse(self, what: str):
        raise RuntimeError(f"{self.nodeid} started a process ({what}) but is not in the dist lane: mark it "
                           "@pytest.mark.dist, or add the name that starts it to tests/conftest.py's _DIST_NAMES")

    def __enter__(self):
        guard, start, popen_init = self, multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

        def refuse_start(process):
            guard.refuse(f"multiprocessing {type(process).__name__}.start")

        def checked_popen_init(popen, args, *rest, **kwargs):
            if _is_python_of_this_environment(args):
                guard.refuse(f"subprocess {args!r}")
            popen_init(popen, args, *rest, **kwargs)

        self._saved = start, popen_init
        multiprocessing.process.BaseProcess.start = refuse_start
        subprocess.Popen.__init__ = checked_popen_init
        return self

    def __exit__(self, *exc):
        multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__ = self._saved
        return False


def _guarded(item):
    return None if item.get_closest_marker("dist") else _ProcessGuard(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    guard = _guarded(item)
    if guard is None:
        return (yield)
    with guard:
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    guard = _guarded(item)
    if guard is None:
        return (yield)
    with guard:
        return (yield)
