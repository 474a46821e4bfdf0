"""The suite's fixture: a private cache for generated data (tests/helpers holds the shared helpers); the
quick tier's marker expression; the suite's report of its own time."""
import os
import time

import pytest

# `--quick` (scripts/test.sh --quick): the working loop's tier, without the tests marked (pyproject.toml)
# as starting several processes or taking long
LEFT_OUT_OF_QUICK = ("slow", "multiprocess", "gpu")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="the quick tier: leave out tests marked " +
                     ", ".join(LEFT_OUT_OF_QUICK))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        left_out = [item for item in items if any(item.get_closest_marker(m) for m in LEFT_OUT_OF_QUICK)]
        items[:] = [item for item in items if item not in left_out]
        config.hook.pytest_deselected(items=left_out)
    # the files with long tests first, each file's tests together and in order: scripts/test.sh runs the
    # files on parallel workers (pytest-xdist, --dist loadfile), and a long file started last would run
    # on alone at the end
    weight = {}
    for item in items:
        marks = {m for m in ("slow", "multiprocess") if item.get_closest_marker(m)}
        weight[item.path] = min(weight.get(item.path, 2), 0 if "slow" in marks else 1 if marks else 2)
    items.sort(key=lambda item: weight[item.path])


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Generated datasets and FLOP counts go to a per-session folder, never the user's cache."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TRAINER_CACHE_DIR")
    os.environ["TRAINER_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("TRAINER_CACHE_DIR", None)
    else:
        os.environ["TRAINER_CACHE_DIR"] = old


# The suite's own report: its wall time against the limit it must fit (CI gives set-up plus tests 90
# minutes, and a slow day runs the suite up to three times slower than a good one), named before it
# cannot land. The exit status stays pytest's.
SUITE_LIMIT_MIN, QUICK_LIMIT_MIN = 45, 3


def pytest_sessionstart(session):
    session.config.suite_started = time.time()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    minutes = (time.time() - config.suite_started) / 60
    if config.getoption("--quick"):
        terminalreporter.write_line(f"quick tier: {minutes:.1f} min (limit {QUICK_LIMIT_MIN})")
        return
    if config.option.markexpr or config.option.keyword or config.args != config.getini("testpaths"):
        return  # a part of the suite: its time says nothing of the whole
    terminalreporter.write_line(f"suite: {minutes:.1f} min (limit {SUITE_LIMIT_MIN})")
    if minutes > SUITE_LIMIT_MIN:
        seconds: dict[str, float] = {}
        for reports in terminalreporter.stats.values():
            for report in reports:
                if getattr(report, "duration", None) is not None and getattr(report, "nodeid", ""):
                    seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
        slowest = sorted(seconds.items(), key=lambda item: -item[1])[:5]
        terminalreporter.write_line(f"WARNING: the suite took {minutes:.1f} min, over its {SUITE_LIMIT_MIN}-minute limit; "
                                    "slowest: " + ", ".join(f"{nodeid} ({s:.0f} s)" for nodeid, s in slowest))
