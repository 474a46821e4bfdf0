"""A run directory: the names of the files a run keeps there, what it holds (the run's saved settings,
a checkpoint to resume from, a finished run, the logs of a run that cannot be continued, a preemption
marker), its lock (train/runlock.py), making it, and what a start does with it (`decide` -> `Start`):
a new run, a restart of its own run (the same command started again: a requeued job, a relaunched
worker), a resume (--resume) or an evaluation (--test-only).

It loads no torch: `python -m train --help` and the flags' parsing read it. The questions that need a
checkpoint's entries (which one a resume reads, whether the run is finished) read them then.
"""
import contextlib
import dataclasses
import os
import re
import shutil
from pathlib import Path

import yaml

from train import runlock
from train.config import DEFINING, RENAMED
from train.errors import RunFinished, UsageError



def current_keys(settings):
    """Saved settings with their old keys renamed (anything but a mapping as it is)."""
    if not isinstance(settings, dict):
        return settings
    return {RENAMED.get(key, key): value for key, value in settings.items()}


class RunDir:
    """One run directory, named by its path (it need not exist yet)."""
    CONFIG = "config.yaml"  # the run's settings as resolved, written at every start
    CHECKPOINT = "checkpoint.pt"  # the latest checkpoint
    BEST_COPY = "checkpoint-best.pt"  # --keep-checkpoints: the best top-1 evaluated
    EPOCH_COPY = re.compile(r"checkpoint-epoch(\d+)\.pt")  # --keep-checkpoints: the checkpoint at an epoch's end
    METRICS = "metrics.jsonl"
    MLLOG = "mllog.txt"
    TENSORBOARD = "tensorboard"  # --tensorboard's event files (rank 0)
    PREEMPTED = "PREEMPTED"  # beside checkpoint.pt while a run stopped by a signal waits for its restart
    LOCK = runlock.LOCK_NAME
    LOST = ".lost"  # the suffix of the files of an attempt lost before its first checkpoint
    RUN_FILES = (CHECKPOINT, MLLOG, METRICS)  # what a run writes once it has started
    PARTIAL_CHECKPOINTS = ".checkpoint*.pt.*.tmp"  # writes cut short (train/checkpoint_writer.py names them)

    def __init__(self, path):
        self.path = Path(path)
        self._saved = None

    def __str__(self) -> str:
        return str(self.path)

    # its files ----------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def checkpoint(self) -> Path:
        return self.path / self.CHECKPOINT

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def mllog(self) -> Path:
        return self.path / self.MLLOG

    @property
    def tensorboard(self) -> Path:
        return self.path / self.TENSORBOARD

    @property
    def preempted_marker(self) -> Path:
        return self.path / self.PREEMPTED

    def epoch_copy(self, epoch: int) -> Path:
        return self.path / f"checkpoint-epoch{epoch:03d}.pt"

    def epoch_copies(self) -> list[tuple[int, Path]]:
        """The kept copies of epochs' ends, (epoch, path), oldest first."""
        return sorted((int(match.group(1)), path) for path in self.path.iterdir()
                      if (match := self.EPOCH_COPY.fullmatch(path.name)))

    def checkpoints(self) -> list[Path]:
        """checkpoint.pt and the kept copies, by name."""
        return sorted(self.path.glob("checkpoint*.pt"))

    def partial_checkpoints(self) -> list[Path]:
        return list(self.path.glob(self.PARTIAL_CHECKPOINTS))

    # what it holds -------------------------------------------------------------------------------
    def saved_settings(self) -> dict:
        """config.yaml's settings as plain YAML (old keys renamed), read once: later calls answer from
        the first read. Raises OSError or yaml.YAMLError for the caller to word."""
        if self._saved is None:
            values = yaml.safe_load(self.config.read_text())
            self._saved = current_keys(values) if values is not None else {}
        return self._saved

    def holds_config(self) -> bool:
        """Whether config.yaml is there now (asked of the disk each time)."""
        return self.config.is_file()

    def resumable(self) -> bool:
        """Whether it holds a checkpoint to resume from (checkpoint.pt or a kept copy)."""
        return bool(self.checkpoints())

    def holds_logs_only(self) -> bool:
        """Whether it holds a run's files but not the config.yaml to continue it from (asked of the disk now)."""
        return not self.holds_config() and any((self.path / name).exists() for name in self.RUN_FILES)

    def preempted_at(self) -> "str | None":
        """The step a run stopped by a signal saved last, as its marker says (None: not stopped so)."""
        marker = self.preempted_marker
        return marker.read_text().strip().removeprefix("step ") if marker.is_file() else None

    def to_resume(self) -> tuple[Path, str]:
        """The checkpoint a resume reads: checkpoint.pt, or where it is missing or cannot be read, the kept
        copy (--keep-checkpoints) of the highest step that can, with a line saying which and why ("" for
        checkpoint.pt). None readable: checkpoint.pt's refusal, naming the copies that failed too."""
        from train.checkpoint_read import peek  # (torch: not for --help)
        latest = self.checkpoint
        try:
            peek(latest)
            return latest, ""
        except UsageError as err:
            refused = err
        intact, broken = [], []
        for copy in sorted(self.path.glob("checkpoint-*.pt")):
            try:
                intact.append((peek(copy)["step"], copy))
            except UsageError:
                broken.append(copy.name)
        if not intact:
            raise UsageError(f"{refused}; the kept copies {', '.join(broken)} cannot be read either") if broken else refused
        step, newest = max(intact)
        why = refused.why if latest.exists() else "it is missing"
        return newest, (f"{latest} cannot be read ({why}): resuming from {newest.name}, the newest intact "
                        f"checkpoint of the run (step {step})")

    def saved_position(self) -> dict:
        """The small entries (step, epoch, finished, classes, ...) of the checkpoint a resume reads."""
        from train.checkpoint_read import peek
        return peek(self.to_resume()[0])

    def to_evaluate(self, name: str) -> Path:
        """The checkpoint --test-only evaluates: --test-checkpoint's file (a name in the run directory, such as
        checkpoint-best.pt, or a path), else the run's checkpoint.pt."""
        if not name:
            if not self.checkpoint.is_file():
                raise UsageError(f"{self.path} holds no {self.CHECKPOINT} to evaluate; check --out-dir")
            return self.checkpoint
        found = next((path for path in (self.path / name, Path(name)) if path.is_file()), None)
        if found is None:
            kept = [path.name for path in self.checkpoints()]
            raise UsageError(f"--test-checkpoint {name} is neither a file in {self.path} nor a path; "
                             f"{self.path} holds {', '.join(kept) or 'no checkpoint'}")
        return found

    def left_to_continue(self, written: bool) -> str:
        """What a stopped run leaves to continue from, for its last line (`written`: --save-checkpoints)."""
        from train.checkpoint_read import peek
        off = "" if written else "this run writes no checkpoint (--no-save-checkpoints); "
        try:
            return f"{off}the last good checkpoint (step {peek(self.checkpoint)['step']}) is kept in {self.path}"
        except (OSError, UsageError):  # none yet (or none readable): the run starts again from step 0
            return f"{off}no checkpoint was written yet in {self.path}"

    # the checks of a start (read-only) -------------------------------------------------------------
    def check(self, cfg, start: "Start", elastic: bool = False) -> None:
        """Whether this start may go on in the directory: no live job of another holds it, a restart's
        command defines the run it finds, a resume has a checkpoint, the run is not over, and no other
        run's files are in the way."""
        if self.path.is_dir():  # another job running in it: refused before anything else
            runlock.check(self.path, elastic=elastic)
        if start.restarted:
            self.check_same_run(cfg)
        self.check_continuable(cfg)

    def check_same_run(self, cfg) -> None:
        """A command that found a run here continues it only if it defines the same run."""
        try:
            saved = self.saved_settings()
        except (OSError, yaml.YAMLError) as err:
            raise UsageError(f"{self.config} cannot be read ({str(err).splitlines()[0]}); "
                             "fix it or choose another --out-dir")

        def same(name, old, new):
            if name in ("data_dir", "init_from"):  # paths: the same file however it is spelled
                return (Path(old).resolve() if old else "") == (Path(new).resolve() if new else "")
            return old == new
        differ = [f"{name} {as_typed(saved[name])} there, {as_typed(getattr(cfg, name))} here" for name in DEFINING
                  if name in saved and not same(name, saved[name], getattr(cfg, name))]
        if differ:
            raise UsageError(f"{self.path} holds a run with other settings ({'; '.join(differ)}); start it with its "
                             "own settings to continue it, --resume to change them on purpose, or choose another --out-dir")

    def check_continuable(self, cfg) -> None:
        """--resume has a checkpoint; a finished run stays as it is (RunFinished: a restarted finished job
        is not a failure); files of a run without its config.yaml are another run's."""
        resumable = self.resumable()
        if cfg.resume and not resumable:
            raise UsageError(f"{self.path} holds no {self.CHECKPOINT} to resume from; check --out-dir or drop --resume")
        if resumable:
            done = nothing_left(cfg, self.saved_position())
            if done:
                raise RunFinished(f"{self.path} holds a finished run ({done}); nothing to do, its files are unchanged")
        # config.yaml as it is now, not when the flags were read: under Horovod Elastic rank 0 may have made
        # the run since (config.yaml first, then its logs), and the others must not take that for another run
        if not cfg.resume and self.holds_logs_only():
            raise UsageError(f"{self.path} already holds a run without the {self.CHECKPOINT} and {self.CONFIG} to "
                             "continue it from; choose another --out-dir or remove it")

    # its lock and making it -------------------------------------------------------------------------
    def take_lock(self, elastic: bool = False) -> "runlock.RunLock":
        """The lock rank 0 holds while the job runs (a refusal while another live job holds it)."""
        return runlock.RunLock.acquire(self.path, elastic=elastic)

    def make(self, settings: dict, start: "Start", elastic: bool = False) -> "runlock.RunLock":
        """Rank 0's part of a start: the folder made, its lock taken, a restart's lost attempt moved aside
        (kept as *.lost), and config.yaml written whole. A failure leaves nothing behind: the folders made
        for it are removed again, and a job refused by the lock writes nothing at all."""
        first_new = next((p for p in reversed([self.path, *self.path.parents]) if not p.exists()), None)
        written = self.path / f".{self.CONFIG}.{os.getpid()}.tmp"
        lock, made = None, False
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            made = True
            lock = self.take_lock(elastic)  # (a refusal leaves the folder to the job that holds it)
            # lost before its first checkpoint: nothing of it to keep (but a worker joining a running Horovod
            # Elastic job finds the job's own files, which stay)
            if start.restarted and not start.from_checkpoint and not elastic:
                print(start.reason, flush=True)
                for name in self.RUN_FILES:  # moved aside, never deleted
                    if (self.path / name).exists():
                        os.replace(self.path / name, self.path / f"{name}{self.LOST}")
            # whole or not at all (another rank, or a worker joining later, may read it at any moment)
            written.write_text(yaml.safe_dump(settings, sort_keys=False))
            os.replace(written, self.config)
            self._saved = None  # (read again from the disk when asked: the file is this start's now)
        except OSError as err:
            with contextlib.suppress(OSError):
                written.unlink(missing_ok=True)
            if lock is not None:
                lock.release()
            if first_new is not None and (lock is not None or not made):  # (never a folder another job holds)
                shutil.rmtree(first_new, ignore_errors=True)
            raise UsageError(f"cannot write the run directory {self.path} ({err.strerror or err}); "
                             "choose a writable --out-dir") from err
        return lock


def nothing_left(cfg, saved: dict) -> str:
    """Why a saved run (its checkpoint's entries) has no step left to take under these settings, or "" when it has."""
    if saved.get("finished") == "target":
        return f"reached --target-accuracy at step {saved['step']}"
    if saved.get("finished") == "epochs" and saved["epoch"] >= cfg.epochs:
        return f"all {saved['epoch']} epochs done at step {saved['step']}"
    if cfg.resume and 0 < cfg.max_steps <= saved["step"]:
        return f"at step {saved['step']}, --max-steps {cfg.max_steps}"
    return ""


def as_typed(value) -> str:
    """A setting as a user would type it: a float without its binary noise (0.4 x 3 epochs of warmup is
    1.2, not 1.2000000000000002), anything else as Python writes it."""
    return f"{value:.10g}" if isinstance(value, float) else repr(value)


# the decision ------------------------------------------------------------------------------------
NEW, RESTART, RESUME, EVALUATE = "new", "restart", "resume", "evaluate"


@dataclasses.dataclass(frozen=True)
class Start:
    """What a start does with its run directory, and why (one line), with what the command line takes
    from the run it found. Decided once, from the flags and the directory, before any settings resolve."""
    kind: str  # NEW; RESTART: the command found its own run (its config.yaml); RESUME: --resume; EVALUATE: --test-only
    reason: str
    from_checkpoint: bool = False  # the run continues from a checkpoint (a resume, a restart of a run that saved one)
    saved_batch: tuple = ()  # a continued run's (per-rank batch, accumulation steps), kept where the rank count allows
    command_batch: tuple = ()  # a restart's own --batch-size and --accumulation-steps (0: not given), not taken
    run_dir: "RunDir | None" = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def restarted(self) -> bool:
        return self.kind == RESTART


def keep_batch(start: Start, global_batch: "int | None", batch_flags_given: bool) -> Start:
    """The start with the batch of the run it continues kept (`saved_batch`): the global batch defines the
    run, so a restart that names no other global batch (`global_batch`: the command's, None if not
    given), or a --resume without batch flags, keeps the saved per-rank batch and accumulation steps
    (batches.split_batch keeps them where the new rank count divides)."""
    if start.kind == RESTART:
        saved = start.run_dir.saved_settings()
        if global_batch is not None and global_batch != saved.get("global_batch_size"):
            return start
    elif start.kind == RESUME and not batch_flags_given:
        saved = start.run_dir.saved_settings()
    else:
        return start
    if not saved.get("global_batch_size"):
        return start
    kept = (saved.get("batch_size") or saved["global_batch_size"], saved.get("accumulation_steps") or 1)
    return dataclasses.replace(start, saved_batch=kept)


def start_of(cfg) -> Start:
    """The start a Config made without the command line (by hand, or by cli.parse) makes: the decision
    cli.read_command makes, from the settings and the directory."""
    given = set(cfg.flags_given)
    start = decide(cfg.out_dir, cfg.resume, cfg.test_only)
    return keep_batch(start, cfg.global_batch_size if "global_batch_size" in given else None,
                      bool(given & {"batch_size", "global_batch_size", "accumulation_steps"}))


def decide(out_dir: str, resume: bool, test_only: bool, run_dir: "RunDir | None" = None) -> Start:
    """The start a command makes on `out_dir` ("" for a new time-stamped one): --test-only evaluates,
    --resume resumes, a directory holding a run's config.yaml is the same command started again (restart
    is resume: it continues from the run's checkpoint, or starts it again from step 0 when it was lost
    before its first), anything else is a new run. Refusals are the checks' (RunDir.check) and parse's."""
    run_dir = run_dir or (RunDir(out_dir) if out_dir else None)
    where = run_dir.path if run_dir else out_dir  # (as the path spells it: run/ and ./run are run)
    if test_only:
        return Start(EVALUATE, f"--test-only: evaluating a checkpoint of {where}", run_dir=run_dir)
    if resume:
        return Start(RESUME, f"--resume: continuing the run in {where} from its checkpoint", True, run_dir=run_dir)
    if run_dir is None or not run_dir.holds_config():
        return Start(NEW, f"a new run in {where or 'a new time-stamped folder'}", run_dir=run_dir)
    if run_dir.resumable():
        return Start(RESTART, f"{where} holds its run's {RunDir.CONFIG} and a checkpoint: continuing it", True,
                     run_dir=run_dir)
    return Start(RESTART, f"{where} holds no checkpoint of its run yet: starting it again from step 0 (its logs "
                          "kept as *.lost)", run_dir=run_dir)
