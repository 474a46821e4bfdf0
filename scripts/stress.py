"""Runs one command many times, quiet and under load, and tallies how each run ended: for a failure
seen only now and then (a NaN, a rank dying at exit), how often it comes, under which load, and with
which last words. docs/stress.md has what it found.

    python scripts/stress.py --runs 10 --hogs 0,2 [--pin] [--out stress.json] -- COMMAND ...

--hogs: for each count, that many busy processes beside every run (a CPU-bound Python loop each);
--pin: each hog pinned to core 0, so the ranks on that core slow down and the others do not (their
collectives meet in another order than on an idle machine). The table: per load, runs, failures,
and the failures grouped by their signature (the most telling line of stderr: the trainer's
"error: ..." line, else a C++ abort, else a line naming an error; or the exit code)."""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

# what a failed run's stderr says of why, most telling first: the trainer's own one-line error, a C++
# abort, then any line naming an error (a launcher's traceback comes last)
SIGNATURES = [re.compile(p) for p in (r"^error: ", r"terminate called|Resource deadlock|Aborted|core dumped",
                                      r"not finite|NaN", r"[Ee]rror|abort")]


def hog(pin: bool) -> subprocess.Popen:
    """A process that keeps one core busy until it is killed."""
    command = [sys.executable, "-c", "while True: pass"]
    if pin:
        command = ["taskset", "-c", "0", *command]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def signature(done: subprocess.CompletedProcess) -> str:
    """How a failed run ended, in one line: its last telling stderr line (numbers and paths dropped, so
    that the same failure groups together), else its exit code."""
    lines = [line.strip() for line in (done.stderr or "").splitlines()]
    line = next((line for pattern in SIGNATURES for line in lines if pattern.search(line)), None)
    if line is None:
        return f"exit code {done.returncode}"
    line = re.sub(r"/\S+", "PATH", line)
    return re.sub(r"\d+(\.\d+)?", "N", line)[:160]


def run_under(command: list[str], runs: int, hogs: int, pin: bool, timeout: float) -> dict:
    started_hogs = [hog(pin) for _ in range(hogs)]
    outcomes, seconds = collections.Counter(), []
    try:
        for _ in range(runs):
            began = time.time()
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                outcome = "ok" if done.returncode == 0 else signature(done)
            except subprocess.TimeoutExpired:
                outcome = f"no end within {timeout:g} s"
            seconds.append(round(time.time() - began, 1))
            outcomes[outcome] += 1
    finally:
        for process in started_hogs:
            process.kill()
            process.wait()
    return {"hogs": hogs, "pinned": pin, "runs": runs, "failures": runs - outcomes["ok"],
            "outcomes": dict(outcomes), "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs per load (default: 10)")
    parser.add_argument("--hogs", default="0,2", help="comma-separated busy-process counts, one load each (default: 0,2)")
    parser.add_argument("--pin", action="store_true", help="pin every hog to core 0")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as hung (default: 600)")
    parser.add_argument("--out", help="also write the tallies as JSON here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    loads = [int(n) for n in args.hogs.split(",") if n.strip()]
    results = [run_under(command, args.runs, n, args.pin, args.timeout) for n in loads]
    print(f"{'hogs':>5s} {'runs':>5s} {'failed':>7s}  outcomes")
    for result in results:
        failures = {k: v for k, v in result["outcomes"].items() if k != "ok"}
        print(f"{result['hogs']:>5d} {result['runs']:>5d} {result['failures']:>7d}  " +
              ("; ".join(f"{n}x {what}" for what, n in failures.items()) or "all ok"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "loads": results}, f, indent=2)
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
