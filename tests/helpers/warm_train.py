"""`python -m train` without the interpreter's start, for the tests (tests/helpers/__init__.py, run_train).

Each trainer start pays about 2.5 s of CPU for importing torch, torchvision and the trainer before it
reads its first flag, and the suite starts a trainer a few hundred times. This server pays for the
imports once per test worker and forks a child per run: a real process of its own (its own pid,
exit status, standard streams, working directory and environment) that runs train/__main__.py as
`python -m train` does (runpy, under the name __main__), then ends as the interpreter would (threads
joined, atexit handlers run, streams flushed). The tests that are about the command itself (the
README's default run, one bad-input test) still start a fresh interpreter.

It runs the project's other commands (`python -m train.score`, ...) the same way.

Protocol, one JSON object a line: in {"module", "argv", "cwd", "env", "stdout", "stderr"} (the last two: file
paths for the child's streams); out {"pid"} once the child runs, then {"returncode"} (negative: the
signal that ended it) when it has ended. The server ends when its standard input closes.
"""
import atexit
import json
import os
import runpy
import sys
import threading
import traceback

import train.__main__  # what every start of the trainer imports, imported once here (the module itself
import train.evaluate  # noqa: F401  is run afresh in each child, as the script); train/__main__.py
import train.loop  # noqa: F401  imports a run's modules once its flags are read: here, they are
import train.score  # noqa: F401  imported before; and the scorer's
del sys.modules["train.__main__"]


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the protocol's channel; a child's fd 1 is its own stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            os._exit(run_child(request))
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


def run_child(request: dict) -> int:
    code = 1
    try:
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["argv"]]
        sys.path[0] = os.getcwd()  # as `python -m` puts it
        code = run_module(request["module"])
        threading._shutdown()  # the interpreter's own exit: wait for non-daemon threads,
        atexit._run_exitfuncs()  # then the exit handlers
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    return code


def run_module(module: str) -> int:
    """The module run as `python -m` runs it, with the exit status the interpreter would give."""
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    serve()
