"""The lanes tests/conftest.py builds: a test that starts processes is in `dist` (found, or refused when it
starts one unmarked), a dependency check (`upstream`) runs only when asked. Run on a throw-away suite."""

import pathlib

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")

SUITE = '''
import multiprocessing
import sys

import pytest

from hf_dp_balance.testing.spawn import run_ranks_until


def _rank(rank, world):
    return rank


def test_pure():
    assert 1 + 1 == 2


def test_the_fault_spawner():
    run_ranks_until(_rank, 2, ranks=[0, 1])


def _start(kind):
    if kind == "multiprocessing":  # the names the lanes look for are hidden from them
        getattr(multiprocessing.get_context("spawn"), "Pro" + "cess")(target=print).start()
    else:
        getattr(__import__("subpro" + "cess"), "run")([sys.executable, "-c", "pass"])


@pytest.mark.parametrize("kind", ["multiprocessing", "python"])
def test_a_hidden_start(kind):
    _start(kind)


@pytest.mark.upstream
def test_a_dependency():
    pass
'''


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    dist: processes\n    upstream: a dependency\n")
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_the_quick_lane_runs_pure_tests_and_refuses_a_process_the_names_miss(suite):
    result = suite.runpytest("-m", "not dist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2, deselected=2)  # the fault spawner and the dependency check
    result.stdout.fnmatch_lines(["*test_a_hidden_start?multiprocessing? started a process (multiprocessing*"
                                 "is not in the dist lane*",
                                 "*test_a_hidden_start?python? started a process (subprocess*"])


def test_dependency_checks_run_only_when_asked(suite):
    result = suite.runpytest("-m", "not dist", "-k", "dependency", "-p", "no:cacheprovider")
    result.assert_outcomes(deselected=5)
    result = suite.runpytest("-m", "not dist", "-k", "dependency", "--upstream", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=4)
    result = suite.runpytest("-m", "upstream", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=4)
