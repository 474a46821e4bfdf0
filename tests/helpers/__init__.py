"""Helpers the tests share: the real CLI and launchers run as a user would, the run's metrics, and the
real MLPerf compliance checker. The scripts beside this file run as child processes of the tests
(under real launchers), not as imports."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_train(*args, cwd, timeout=600, env=None, fresh=False) -> subprocess.CompletedProcess:
    """`python -m train ARGS` in a process of its own, as a user would run it (see run_module)."""
    return run_module("train", *args, cwd=cwd, timeout=timeout, env=env, fresh=fresh)


def run_module(module: str, *args, cwd, timeout=600, env=None, fresh=False) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (one of the project's) in a process of its own: forked from this test
    worker's warm trainer (tests/helpers/warm_train.py: the same run without the 2.5 s of imports), or
    with `fresh` a new interpreter."""
    command = [sys.executable, "-m", module, *map(str, args)]
    if fresh:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=child_env(**(env or {})))
    return _warm_trainer().run(command, cwd, timeout, child_env(**(env or {})))


class _WarmTrainer:
    """The client of one warm_train.py server, started on first use and ended with this process
    (its standard input closes)."""

    def __init__(self):
        import atexit
        import shutil
        import tempfile
        self.folder = Path(tempfile.mkdtemp(prefix="warm-train-"))
        atexit.register(shutil.rmtree, self.folder, ignore_errors=True)
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("warm_train.py"))],
                                       cwd=REPO, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=open(self.folder / "server.log", "w"))
        self.replies = b""

    def run(self, command: list, cwd, timeout: float, env: dict) -> subprocess.CompletedProcess:
        import signal
        out, err = self.folder / "stdout", self.folder / "stderr"
        request = {"module": command[2], "argv": command[3:], "cwd": str(Path(cwd).resolve()), "env": env, "stdout": str(out),
                   "stderr": str(err)}
        self.server.stdin.write(json.dumps(request).encode() + b"\n")
        self.server.stdin.flush()
        pid = self._reply()["pid"]
        ended = self._reply(timeout)
        if ended is None:
            os.kill(pid, signal.SIGKILL)
            self._reply()
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess(command, ended["returncode"], out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def _reply(self, timeout: float | None = None) -> dict | None:
        """The server's next line, or None if none came within `timeout` seconds."""
        import select
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.server.stdout.fileno()
        while b"\n" not in self.replies:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                log = (self.folder / "server.log").read_text()
                raise RuntimeError(f"the warm trainer (tests/helpers/warm_train.py) ended: {log[-2000:]}")
            self.replies += chunk
        line, self.replies = self.replies.split(b"\n", 1)
        return json.loads(line)


_warm = None


def _warm_trainer() -> _WarmTrainer:
    global _warm
    if _warm is None or _warm.server.poll() is not None:
        _warm = _WarmTrainer()
    return _warm


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` (a run directory's TensorBoard folder too), by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def compliance(mllog: Path, cwd: Path) -> subprocess.CompletedProcess:
    """The real mlperf_logging compliance checker, called as the scorer calls it (it writes
    compliance_checker.log into cwd)."""
    from train.score import run_checker
    return run_checker(Path(mllog).resolve(), cwd=cwd, log_output=None)


BIN = Path(sys.executable).parent


def script_options(script: Path) -> dict[str, str]:
    """A script's options as its --help lists them: option -> its help text ("" when it has none)."""
    import re
    done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("\noptions:\n", 1)[1]
    said = {}
    for entry in re.split(r"\n(?=  -)", options.strip("\n")):  # (one per option: its line and the help's next lines)
        first, *more = entry.splitlines()
        invocation, _, help_text = first.strip().partition("  ")
        said[invocation.split()[0].rstrip(",")] = " ".join([help_text, *more]).strip()
    return said


def child_env(**extra) -> dict:
    """This environment, with the checkout first on PYTHONPATH (what was there stays after it)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def launch_command(launcher: str, nproc: int, *args) -> list[str]:
    """The real launcher's command line: torchrun ("torch"), horovodrun with gloo ("horovod") or MPI
    ("horovod-mpi"), Open MPI's mpirun ("mpirun"), or a plain process ("none")."""
    args = list(map(str, args))
    if launcher == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                "--master-port", str(free_port()), *args]
    if launcher in ("horovod", "horovod-mpi"):
        return [str(BIN / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}",
                "--gloo" if launcher == "horovod" else "--mpi", sys.executable, *args]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), sys.executable, *args]
    assert nproc == 1
    return [sys.executable, *args]


def launch(launcher: str, nproc: int, *args, cwd, timeout=600, env=None) -> subprocess.CompletedProcess:
    if launcher == "none" and list(map(str, args[:2])) == ["-m", "train"]:  # a plain trainer: the warm one
        return run_train(*args[2:], cwd=cwd, timeout=timeout, env=env)
    return subprocess.run(launch_command(launcher, nproc, *args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=child_env(**(env or {})))


# processes of real launchers, for the tests that kill ranks (tests/test_elastic_torchrun.py, tests/test_slurm.py)

def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (a launcher's rendezvous endpoint)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of `pid`, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if int(parent) == pid and state != "Z":
            found.append(int(entry.name))
    return found


def process_env(pid: int) -> dict:
    """A live process's environment ({} once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the trainer processes a torchrun agent runs now."""
    workers = {}
    for pid in children(agent_pid):
        env = process_env(pid)
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            workers[int(env["RANK"])] = pid
    return workers


def start(command: list, cwd, log: Path, env=None) -> subprocess.Popen:
    """A launcher started in its own process group (so that it and all it started can be killed at
    once), its output to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(list(map(str, command)), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env=child_env(**(env or {})), start_new_session=True)
    proc.log = log  # what wait_until shows when the launcher ends first
    return proc


def descendants(pid: int) -> list[int]:
    """Every live process started by `pid`, by its children and so on (whatever their session)."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process started by `start`, its process group and every process it started (torchrun
    starts each worker in a session of its own: killing the agent's group leaves them running); reap it."""
    import signal
    everything = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in everything:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def wait_until(condition, timeout: float, what: str, alive=()):
    """condition()'s first truthy value, polled every 50 ms; fails after `timeout` seconds, or as soon
    as a process in `alive` has ended."""
    import time
    deadline = time.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        for proc in alive:
            if proc.poll() is not None:
                said = proc.log.read_text()[-4000:] if hasattr(proc, "log") else ""
                raise AssertionError(f"{what}: the process ended first (exit {proc.returncode})\n{said}")
        if time.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


# a one-epoch resnet18 run at 32 px on the embedded dataset: the trained model predict, export and
# the benchmarks are tested on
TINY_TRAINED_RUN = ["--arch", "resnet18", "--image-size", 32, "--epochs", 1, "--global-batch-size", 32,
                    "--workers", 0, "--eval-every", 0]


def tiny_trained_run(root: Path) -> Path:
    """root, holding such a run in root/run."""
    done = run_train("--out-dir", root / "run", *TINY_TRAINED_RUN, cwd=root)
    assert done.returncode == 0, done.stderr
    return root


def stand_in_for_horovod(monkeypatch, hvd) -> None:
    """`import horovod.torch as hvd` gives `hvd` for the test: in sys.modules, and as the attribute of
    the real horovod package when another test of this worker has loaded it (then the import takes
    the attribute, not sys.modules)."""
    import sys
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)
    if "horovod" in sys.modules:
        monkeypatch.setattr(sys.modules["horovod"], "torch", hvd, raising=False)


def resnet50_kept_values() -> int:
    """The values backward keeps of one 224 px image of ResNet-50, counted on the meta device (the memory
    model's tally, docs/planner.md): the input, each convolution's output (BatchNorm's input), each
    BatchNorm's output (ReLU runs in place on it), the max-pool's output."""
    import torch
    from models import build_model
    counted = [3 * 224 * 224]

    def count(module, inputs, output):
        counted[0] += output.numel()
    net = build_model("resnet50").to("meta")
    for module in net.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.MaxPool2d)):
            module.register_forward_hook(count)
    net(torch.zeros(1, 3, 224, 224, device="meta"))
    return counted[0]


def loader_settings(*, evaluate_only: bool = False, relist: bool = False, **settings):
    """The LoaderSettings of a run with these settings over the trainer's defaults (train.config.Config's),
    its precision resolved as on a CPU (fp32) unless given."""
    from data import LoaderSettings
    from train.config import Config
    run = Config(**{"precision": "fp32", **settings})
    return LoaderSettings.of(run, evaluate_only=evaluate_only, relist=relist)
