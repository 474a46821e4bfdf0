"""Two counts of what a reader of `python -m train` meets before the first optimizer step, for comparing
two versions of the trainer (the same command run by each):

    python scripts/reading_counts.py [--repo CHECKOUT] [--json] [-- TRAIN FLAGS ...]

It runs `python -m train` of CHECKOUT (default: this one) in a process of its own under a profile hook
(sys.setprofile, and threading.setprofile for the loader's threads) installed before the trainer's
first import, so import time counts. Train flags by default: the default run (the smoke preset, ResNet-50
at 32 px on the embedded dataset) with `--max-steps 2 --out-dir TMP/run` (two steps: the second's stack
tells the first step's own frames apart; flags given replace these), about 10 s on a 2-core CPU; the
embedded dataset is generated beforehand, in another process, so its generation is not counted. The
first optimizer step is the first call of a `step` method of a torch.optim.Optimizer (the optimizer's
own step, under torch's wrappers); the code counted is whatever lies in CHECKOUT's train/, data/ and
models/.

- Functions entered: every distinct function (file, qualified name) of that code entered, on any
  thread of the rank's process, from the process start until the first optimizer step (that step's
  own frame left out). Module bodies run at import are counted apart, as modules; a lambda or a
  comprehension is part of the function it is written in.
- Names followed: the functions of that code on the call stack at the first optimizer step, plus the
  ones those stack frames had called before it (through library code in between, as `self.model(x)`
  reaches a model's forward through torch): what a reader reads, or steps over, in the bodies on the
  path from `python -m train` to the step. The step's own frames are those the second optimizer step
  no longer has on its stack (it entered them anew); "before the step" counts the followed names first
  entered before the outermost of them, the set-up a reader goes through before the step's code.

Processes the trainer starts (the checkpoint writer) are not counted. The script measures; its
numbers vary a little with the flags and the machine (the loader's threads, the checks a GPU adds)."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "data", "models")
DEFAULT_FLAGS = ["--max-steps", "2"]  # (--out-dir added: a temporary folder)
NOT_OURS = object()  # the code-object cache's answer for code outside PACKAGES


class Recorder:
    """The profile hook and what it gathers: the first entry (an order number) of every function and
    module body of the counted code until the first optimizer step; the counted functions called by
    each live frame of counted code (to the nearest counted frame up the stack); the stack at the first
    and at the second optimizer step."""

    def __init__(self, root: Path):
        root = root.resolve()
        self.prefixes = tuple(str(root / package) + os.sep for package in PACKAGES)
        self.root = str(root) + os.sep
        self.names: dict = {}  # id(code object) -> (code object, (file, qualified name) or NOT_OURS)
        self.first_entry: dict = {}  # (file, qualified name) -> order of its first entry
        self.modules: dict = {}  # file -> order of its module body's first entry
        self.live: dict = {}  # id(frame) -> [name, order entered, names it called]
        self.order = 0
        self.steps_seen = 0
        self.first_step_stack: list = []  # [(frame, name, order entered, names it called)], outermost first
        self.own_frames_of_step: list = []

    def name_of(self, code):
        # by id: code objects compare equal across files when their text and line numbers are alike; the
        # code object is kept with its name, so that its id stays its own
        known = self.names.get(id(code))
        if known is None:
            path = os.path.realpath(code.co_filename)
            inner = code.co_name.startswith(("<lambda", "<genexpr", "<listcomp", "<setcomp", "<dictcomp"))
            ours = path.startswith(self.prefixes) and not inner
            name = (path[len(self.root):], code.co_qualname) if ours else NOT_OURS
            known = self.names[id(code)] = (code, name)
        return known[1]

    def hook(self, frame, event, arg):
        if self.steps_seen >= 2 or (event != "call" and event != "return"):
            return
        code = frame.f_code
        if event == "call" and code.co_name == "step" and self._is_optimizer_step(frame):
            self._at_step(frame)
            return
        if self.steps_seen:  # past the first step: only the second's stack is wanted
            return
        name = self.name_of(code)
        if name is NOT_OURS:
            return
        if event == "return":
            self.live.pop(id(frame), None)
            return
        self.order += 1
        if name[1] == "<module>":
            self.modules.setdefault(name[0], self.order)
        else:
            self.first_entry.setdefault(name, self.order)
        self.live[id(frame)] = [name, self.order, set()]
        caller = self._nearest_counted(frame.f_back)
        if caller is not None and id(caller) in self.live:
            self.live[id(caller)][2].add(name)

    def _nearest_counted(self, frame):
        while frame is not None and self.name_of(frame.f_code) is NOT_OURS:
            frame = frame.f_back
        return frame

    @staticmethod
    def _is_optimizer_step(frame) -> bool:
        optim = sys.modules.get("torch.optim")
        return optim is not None and isinstance(frame.f_locals.get("self"), optim.Optimizer)

    def _at_step(self, step_frame) -> None:
        self.steps_seen += 1
        stack = []
        frame = self._nearest_counted(step_frame.f_back)
        while frame is not None:
            entry = self.live.get(id(frame))
            if entry is not None:
                stack.append((frame, *entry))
            frame = self._nearest_counted(frame.f_back)
        stack.reverse()
        if self.steps_seen == 1:
            self.first_step_stack = stack
            return
        still_there = {id(entry[0]) for entry in stack}
        self.own_frames_of_step = [entry for entry in self.first_step_stack if id(entry[0]) not in still_there]
        self.first_step_stack = [entry[1:] for entry in self.first_step_stack]  # the frames themselves let go
        self.own_frames_of_step = [entry[1:] for entry in self.own_frames_of_step]
        sys.setprofile(None)
        threading.setprofile(None)

    def counts(self) -> dict:
        """What the two counts found, with the names behind them."""
        if self.steps_seen < 2:
            return {"error": "the run ended before its second optimizer step: give it two or more steps "
                             "(--max-steps 2, an epoch of at least 2 steps)"}
        followed = {name for name, _, _ in self.first_step_stack}
        for _, _, called in self.first_step_stack:
            followed |= called
        followed = {name for name in followed if name[1] != "<module>"}  # functions only, as above
        step_entered = min(order for _, order, _ in self.own_frames_of_step)
        before = {name for name in followed if self.first_entry[name] < step_entered}
        return {
            "functions_entered": len(self.first_entry),
            "files_entered": len({file for file, _ in self.first_entry}),
            "modules_imported": len(self.modules),
            "names_followed": len(followed),
            "files_followed": len({file for file, _ in followed}),
            "followed_before_step": len(before),
            "stack_at_step": [f"{file}:{name}" for (file, name), _, _ in self.first_step_stack],
            "own_frames_of_step": [f"{file}:{name}" for (file, name), _, _ in self.own_frames_of_step],
            "followed": sorted(f"{file}:{name}" for file, name in followed),
            "entered": sorted(f"{file}:{name}" for file, name in self.first_entry),
        }


def measure(root: Path, flags: list, result_path: Path) -> int:
    """In the measured process: `python -m train FLAGS` of `root` under the hook; the counts to
    `result_path`. Returns the trainer's exit code."""
    import runpy
    sys.path[0] = str(root)  # as `python -m train` run from the checkout: its packages first
    recorder = Recorder(root)
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    sys.argv = ["train", *flags]
    try:
        runpy.run_module("train", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    imported = Path(sys.modules["train"].__file__).resolve()
    if imported.is_relative_to(root):
        result_path.write_text(json.dumps(recorder.counts()))
    else:
        result_path.write_text(json.dumps({"error": f"the trainer imported was {imported}, not {root}'s"}))
    return code


class Refused(Exception):
    """A measurement that could not be made: the line that says why, and the exit code."""


def run_measured(root: Path, flags: list) -> dict:
    """Generates the embedded dataset outside the measured process (a no-op once cached), then measures."""
    python = sys.executable
    if "--data-dir" not in flags:
        made = subprocess.run([python, "-c", "from data.embedded import ensure_embedded; ensure_embedded()"],
                              cwd=root, capture_output=True, text=True)
        if made.returncode != 0:
            raise Refused(f"error: the embedded dataset could not be generated with {root}'s data/embedded.py: "
                          f"{(made.stderr.strip().splitlines() or ['?'])[-1]}", 1)
    with tempfile.TemporaryDirectory(prefix="reading_counts-") as scratch:
        if "--out-dir" not in flags:
            flags = [*flags, "--out-dir", str(Path(scratch) / "run")]
        result_path = Path(scratch) / "counts.json"
        command = [python, str(Path(__file__).resolve()), "--measure", str(result_path), "--repo", str(root),
                   "--", *flags]
        finished = subprocess.run(command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if finished.returncode != 0 or not result_path.exists():  # (the trainer's own error line ends its stderr)
            raise Refused(f"{finished.stderr.strip()[-2000:]}\nerror: python -m train {' '.join(flags)} of {root} "
                          f"exited with {finished.returncode}", finished.returncode or 1)
        counts = json.loads(result_path.read_text())
        if "error" in counts:
            raise Refused(f"error: {counts['error']}", 2)
    counts["repository"], counts["train_flags"] = str(root), flags
    return counts


def table(counts: dict) -> str:
    rows = [("functions entered before the first optimizer step", counts["functions_entered"]),
            ("  in files", counts["files_entered"]),
            ("  module bodies run (imports), apart", counts["modules_imported"]),
            ("names followed from python -m train to the step", counts["names_followed"]),
            ("  in files", counts["files_followed"]),
            ("  entered before the step's own frames", counts["followed_before_step"])]
    lines = [f"{counts['repository']}: python -m train {' '.join(counts['train_flags'])}"]
    lines += [f"{label:<54} {value:>5}" for label, value in rows]
    lines.append("stack at the step: " + " > ".join(name.split(":")[1] for name in counts["stack_at_step"]))
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1].strip())
    parser.add_argument("--repo", type=Path, default=REPOSITORY, help="the checkout to measure (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the counts and the names behind them as JSON")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # (the measured process)
    args = parser.parse_args(ours)
    root = args.repo.resolve()
    if not (root / "train" / "__main__.py").is_file():
        print(f"error: {root} holds no train/__main__.py: name a checkout of the trainer with --repo", file=sys.stderr)
        return 2
    flags = DEFAULT_FLAGS if flags is None else flags
    if args.measure:
        return measure(root, flags, args.measure)
    try:
        counts = run_measured(root, flags)
    except Refused as refused:
        message, code = refused.args
        print(message, file=sys.stderr)
        return code
    print(json.dumps(counts, indent=1) if args.json else table(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
