"""The quick tier (`scripts/test.sh --quick`) is the suite without the tests marked slow, multiprocess, cluster
or gpu, and it still calls every module of train/, data/ and models/ (read from the tests' source by
tests/helpers/reach.py)."""
import json
import subprocess
import sys

from helpers import REPO, child_env
from helpers.reach import our_modules, reached_by


def collected(*options) -> list[str]:
    """The node ids pytest itself selects with these options."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *options],
                            cwd=REPO, capture_output=True, text=True, timeout=600, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_the_quick_tier_leaves_out_exactly_the_marked_tests_and_calls_every_module():
    quick = collected("--quick")
    assert sorted(quick) == sorted(collected("-m", "not (slow or multiprocess or cluster or gpu)"))
    assert "tests/test_quick_tier.py::" + test_the_quick_tier_leaves_out_exactly_the_marked_tests_and_calls_every_module.__name__ in quick
    missing = sorted(our_modules() - reached_by(quick))
    assert not missing, f"no quick test calls {', '.join(missing)}: add one, or take a mark off a test that does"


def test_a_test_marked_alone_runs_while_no_other_test_runs(tmp_path):
    """Two parallel workers (scripts/test.sh's way), one file each: the `alone` test's run overlaps none
    of the other file's tests, which would all run beside it otherwise, nor the set-up of their
    module's fixture (a cluster's or a trained run's, in the suite)."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_runtest_protocol = suite.pytest_runtest_protocol\n\n"
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'alone: the machine to itself')\n")
    timed = ("import json, time\n\ndef timed(name, seconds):\n    started = time.time()\n    time.sleep(seconds)\n"
             f"    with open({str(tmp_path / 'times.jsonl')!r}, 'a') as f:\n"
             "        f.write(json.dumps([name, started, time.time()]) + '\\n')\n\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # (not the project's settings)
    (tmp_path / "test_a.py").write_text("import pytest\n" + timed + "@pytest.mark.alone\ndef test_alone():\n"
                                        "    time.sleep(0.5)\n    timed('alone', 2)\n")
    (tmp_path / "test_b.py").write_text("import pytest\n" + timed + "@pytest.fixture(scope='module')\ndef made():\n"
                                        "    timed('fixture', 1.5)\n\n" +
                                        "".join(f"def test_{i}(made):\n    timed('{i}', 1)\n\n" for i in range(4)))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                             "-c", str(tmp_path / "pytest.ini"), str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    times = {name: (start, end) for name, start, end in map(json.loads, (tmp_path / "times.jsonl").read_text().splitlines())}
    start, end = times.pop("alone")
    assert len(times) == 5 and all(other_end <= start or other_start >= end for other_start, other_end in times.values()), times
