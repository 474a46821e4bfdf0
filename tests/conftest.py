"""The suite's fixtures: a private cache for generated data, and the machine to itself for a test marked
`alone` (tests/helpers holds the shared helpers); the quick tier's marker expression; the suite's report
of its own time."""
import fcntl
import os
import tempfile
import time

import pytest

# The suite runs trainers side by side (parallel workers, several ranks each) on few cores, where
# OpenMP's idle threads spinning for work take the cores the others need: here they wait asleep (on
# 3 test files under 2 workers: 278 s and 451 s of user CPU spinning, 210 s and 297 s asleep). Set here,
# before any test imports torch, and inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# `--quick` (scripts/test.sh --quick): the working loop's tier, without the tests marked (pyproject.toml)
# as starting several processes or taking long
LEFT_OUT_OF_QUICK = ("slow", "multiprocess", "cluster", "gpu")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="the quick tier: leave out tests marked " +
                     ", ".join(LEFT_OUT_OF_QUICK))


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        left_out = [item for item in items if any(item.get_closest_marker(m) for m in LEFT_OUT_OF_QUICK)]
        items[:] = [item for item in items if item not in left_out]
        config.hook.pytest_deselected(items=left_out)
    # the files with the most work first, each file's tests together and in order: scripts/test.sh runs
    # the files on parallel workers (pytest-xdist, --dist loadfile, in this order), and a long file
    # started last would run on alone at the end. The work is guessed from the marks: a slow test 5 s
    # unless its mark says more (@pytest.mark.slow(seconds=...)), a multiprocess one 20 s, others 0.5 s
    work: dict = {}
    for item in items:
        slow, multiprocess = item.get_closest_marker("slow"), item.get_closest_marker("multiprocess")
        seconds = slow.kwargs.get("seconds", 5) if slow else 20 if multiprocess else 0.5
        work[item.path] = work.get(item.path, 0) + seconds
    items.sort(key=lambda item: -work[item.path])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under parallel workers, a test marked `alone` runs with the machine to itself: it closes a gate
    that keeps the other worker's next test from starting, waits for that worker's running test to end,
    and opens the gate when it is done. Every other test holds a shared lock while it runs. Held around
    the test's whole protocol, not in a fixture: the set-up of a module's or the session's fixtures (a
    cluster of namespaces, a trained run) falls in its first test's, and teardown in its last test's."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    base = os.path.join(tempfile.gettempdir(), f"trainer-tests-{run}")
    with open(base + ".gate", "a") as gate, open(base + ".lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)  # (closing the files lets both locks go)


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


@pytest.hookimpl(trylast=True)  # after the slowest durations, which it stands beside
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
