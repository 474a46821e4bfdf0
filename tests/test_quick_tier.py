"""The quick tier (`scripts/test.sh --quick`) is the suite without the tests marked slow, multiprocess, cluster
or gpu, and it still calls every module of train/, data/ and models/ (read from the tests' source by
tests/helpers/reach.py)."""
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
