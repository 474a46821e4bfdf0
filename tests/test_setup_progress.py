"""The Horovod build in set-up says it is still going (scripts/ticker.sh's with_ticker, which
scripts/install_horovod.sh wraps the quiet pip build in), tested with stand-in commands: the real
build takes minutes of every core."""
import os
import re
import subprocess
import time

from helpers import REPO

TICKER = REPO / "scripts" / "ticker.sh"


def ticked(every_s: str, command: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """`command` run by a strict shell (as install_horovod.sh runs) that has sourced the ticker."""
    script = f'set -euo pipefail; source "{TICKER}"; {command}; echo "after: $?"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "TRAINER_TICKER_EVERY_S": every_s})


def test_a_long_command_says_what_it_does_and_how_long_it_has_been_going():
    result = ticked("0.25", 'with_ticker "building Horovod from source" sleep 1.4')
    assert result.returncode == 0 and result.stdout == "after: 0\n", result
    lines = result.stderr.splitlines()
    assert 1 <= len(lines) <= 6 and all(re.fullmatch(r"building Horovod from source: 0:0[0-2] so far", line)
                                        for line in lines), lines


def test_the_ticker_ends_with_its_command_and_the_command_decides_the_exit_status():
    """A failing build: its status (3) is the script's, under set -e the script stops there, and no
    ticker (nor its sleep, which would hold the output pipe open) outlives it."""
    every = f"29.{os.getpid() % 1000:03d}7"  # a period no other sleep here has, to find the ticker's by
    started = time.monotonic()
    result = ticked(every, 'with_ticker "building" sh -c "sleep 0.3; exit 3"')
    assert result.returncode == 3 and result.stdout == "" and result.stderr == "", result
    assert time.monotonic() - started < 10  # the pipes closed with the script, not a period later
    left = subprocess.run(["pgrep", "-f", f"sleep {every}"], capture_output=True, text=True).stdout.split()
    assert not left, f"the ticker's sleep outlived it: {left}"
    assert ticked(every, 'with_ticker "building" true').stdout == "after: 0\n"  # a short command: no line


def test_install_horovod_wraps_the_build_in_the_ticker():
    script = (REPO / "scripts" / "install_horovod.sh").read_text()
    assert "source scripts/ticker.sh" in script
    build = re.search(r'with_ticker "install_horovod: building Horovod [^"]*" \\\n\s+"\$PY" -m pip wheel', script)
    assert build, "the pip wheel build is not wrapped in with_ticker"
