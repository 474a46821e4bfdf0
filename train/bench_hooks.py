"""The hooks `python -m train.bench train` gives the training loop (train/hooks.py; docs/bench.md):
StepTimer times each step's wait for its batch and its compute, and the step alone at the end;
ProfileTrace writes a torch.profiler trace of a few measured steps per rank."""
import time
from pathlib import Path

import torch

from train.hooks import LoopHooks

QUIET_STEPS = 5  # steps timed again with the loader idle: the step's compute alone
PROFILED_STEPS = 3  # measured steps in a --profile trace


class StepTimer(LoopHooks):
    """Each step's wait for its batch (from asking the loader to the batch being on the device) and its
    compute (from then to the step's end on the device), in seconds, on this rank; it synchronises the
    device around them, which only the benchmark does. After the last measured step, the same step's
    compute alone: the loader left to go quiet, the last batch stepped again QUIET_STEPS times with
    nothing else running, so that a loader that keeps up but takes the cores the step needs shows as
    what it costs (a wait near zero, a slower compute). Then every rank's figures are gathered
    (`ranks`: per rank, its measured steps and its quiet computes). `sizes` holds the crop size of
    each step's batch (a --resolution-schedule changes it between epochs)."""

    def __init__(self, warmup_steps: int, steps: int):
        self.warmup_steps, self.steps = warmup_steps, steps
        self.records: list[tuple[float, float, int]] = []  # (wait, compute, images) per step
        self.sizes: list[int] = []  # the crop size of each step's batch, in pixels
        self.ranks: list | None = None
        self.training = self.engine = self._batch = None
        self._asked = self._got = 0.0

    def run_started(self, training) -> None:
        self.training, self.engine = training, training.engine

    def batch_asked(self) -> None:
        self._asked = time.perf_counter()

    def batch_fetched(self, images, labels) -> None:
        self._sync()  # (the batch's work on the device is part of its wait)
        self._got, self._batch = time.perf_counter(), (images, labels)

    def step_done(self, step: int, loss) -> None:
        self._sync()
        images, labels = self._batch
        self.records.append((self._got - self._asked, time.perf_counter() - self._got, labels.shape[0]))
        self.sizes.append(images.shape[-1])
        if step == self.warmup_steps + self.steps:  # (every rank is here: collectives are safe)
            self.ranks = self.engine.gather_object((self.records[self.warmup_steps:], self.quiet_computes(images, labels)))

    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def quiet_computes(self, images, labels) -> list[float]:
        """The step on this batch again, timed, once this process's other threads (the loader's) are
        idle, as steps aside of the run (Training.steps_aside: what the run prints and logs after is as
        the last measured step left it; the weights and the optimizer's buffers keep the extra steps, a
        benchmark keeps nothing)."""
        wait_for_quiet()
        self.engine.barrier()  # (each rank's first quiet step must not wait for a rank still waiting)
        computes = []
        with self.training.steps_aside() as step_again:
            for _ in range(QUIET_STEPS):
                self._sync()
                started = time.perf_counter()
                step_again(images, labels)
                self._sync()
                computes.append(time.perf_counter() - started)
        return computes


def wait_for_quiet(limit_s: float = 30.0, window_s: float = 0.1) -> None:
    """Until this process uses less than a tenth of a core over a window (its loader threads have
    filled what they may fill ahead and stopped), at most `limit_s`."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        before = time.process_time()
        time.sleep(window_s)
        if time.process_time() - before < 0.1 * window_s:
            return


class ProfileTrace(LoopHooks):
    """A torch.profiler trace of the first measured steps, PROFILED_STEPS of them but never the last
    measured one (after it the StepTimer steps again, which the trace would hold too), with the last
    warm-up step profiled first and dropped (the profiler's own start). The host's side always, the
    GPU's kernels and copies on CUDA; written gzipped as Chrome trace JSON, `trace-rank{R}.json.gz`
    in `folder` for rank R, once the profiled steps are done. Give it after the StepTimer: the
    profiler's work at its last step then falls outside the step's timed compute."""

    def __init__(self, folder: Path, warmup_steps: int, steps: int):
        self.folder, self.wait = Path(folder), warmup_steps - 1
        self.active = min(PROFILED_STEPS, max(1, steps - 1))
        self.profiler, self.written = None, None

    def run_started(self, training) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule
        self.path = self.folder / f"trace-rank{training.engine.rank}.json.gz"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if training.engine.device.type == "cuda" else [])
        self.profiler = profile(activities=activities, on_trace_ready=self._write,
                                schedule=schedule(wait=self.wait, warmup=1, active=self.active, repeat=1))
        self.profiler.start()

    def _write(self, profiler) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.path))  # (gzipped: the name ends in .gz)
        self.written = self.path

    def step_done(self, step: int, loss) -> None:
        self.profiler.step()  # (the profiler's steps count from 0: its step k ends at the run's step k + 1)

    def close(self) -> None:
        """Stops the profiler (a run that ended within the profiled steps writes what it profiled)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
