"""A run's checkpoints: what a checkpoint holds, restoring a run from one, and saving one, in the
background on rank 0 with every rank learning how the write went, so that all stop together when it
failed; and a preemption's checkpoint, on disk before any rank exits. The training loop
(train/loop.py) holds one Checkpoints, given the parts of the run it saves and restores; Horovod
Elastic's commits (train/elastic.py) go through it too."""
import sys
import time
from pathlib import Path

import torch

from train import checkpoint
from train.bnstats import share_bn_statistics
from train.config import to_dict
from train.crops import resolution_ramp
from train.errors import Diverged, Preempted, RunAborted, raised_everywhere
from train.host_memory import host_copy, reserve
from train.meters import SampleLedger


class Checkpoints:
    """A run's checkpoints. Given: `setup` (train/startup.py's: the engine, the precision, the run
    directory, and the settings and the loader, read where used: Horovod Elastic's reshare replaces
    those two), the model and optimizer as the engine wrapped them, the weight average (or None), the
    run's position `state` (train/loop.py's RunState, which a restore sets), the skipped files, the
    ranks' agreement points, the background writer and the run log. What they save holds every one of
    those but the writer and the log."""

    def __init__(self, setup, *, model, optimizer, ema, state, skipped, flag_checks, writer, log):
        self.setup, self.model, self.optimizer, self.ema, self.state = setup, model, optimizer, ema, state
        self.skipped, self.flag_checks, self.writer = skipped, flag_checks, writer
        self.log = log  # (Horovod Elastic: the new rank 0's, once rank 0 moved: Training.reopen_log)
        self.in_flight = None  # the entries of the checkpoint being written, for --keep-checkpoints
        self.host_memory_unreserved = True  # (rank 0's checkpoint copies: reserve_host_memory)

    @property
    def cfg(self):
        return self.setup.cfg

    @property
    def engine(self):
        return self.setup.engine

    @property
    def run_dir(self):
        return self.setup.run_dir

    @property
    def out_dir(self) -> Path:
        return self.setup.run_dir.path

    # what a checkpoint holds ---------------------------------------------------------------------
    def state_dict(self, samples: list[int] | None = None, finished: str | None = None) -> dict:
        """What a checkpoint (and a Horovod Elastic commit) holds; tensors are the live ones. `samples`:
        the epoch's sample ledger as summed over the ranks (None: its last sum, no collective)."""
        s = self.state
        return {"model": self.engine.unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                "precision": self.setup.precision.state_dict(), "step": s.step, "epoch": s.epoch,
                "step_in_epoch": s.step_in_epoch, "samples": s.samples.saved if samples is None else samples,
                "finished": finished, "config": to_dict(self.cfg), "classes": self.setup.loader.class_names,
                "best_top1": s.best_top1, "best_step": s.best_step,
                **({"ema": self.ema.state_dict()} if self.ema else {}), **self.skipped.state_dict()}

    def samples_total(self) -> list[int]:
        """The epoch's sample ledger summed over the ranks (one small all-reduce: every rank calls it)."""
        return self.state.samples.total(self.engine)

    def load_state_dict(self, saved: dict, weights: bool = True) -> None:
        """The run as `saved` holds it (a resume; Horovod Elastic's rollback and state sync), with the
        crop size it trained last."""
        if weights:
            self.engine.unwrap(self.model).load_state_dict(saved["model"])
        if self.ema:  # (a run that turns the average on at a resume has none saved: it starts from the weights)
            self.ema.load_state_dict(saved.get("ema"))
        self.optimizer.load_state_dict(saved["optimizer"])
        self.setup.precision.load_state_dict(saved["precision"])
        s = self.state
        s.step, s.epoch, s.step_in_epoch = saved["step"], saved["epoch"], saved["step_in_epoch"]
        s.stop, s.reached_target = s.step >= self.cfg.max_steps > 0, False  # (a rollback may go back before either)
        s.samples = SampleLedger(saved.get("samples", (0, 0, 0)))
        self.flag_checks.restart(s.step)  # (every rank, at the same step: a resume, a rollback, a state sync)
        s.best_top1, s.best_step = saved.get("best_top1"), saved.get("best_step")  # (none in older checkpoints)
        s.last_crop = crop_trained_last(saved)
        self.skipped.load_state_dict(saved)

    def resume(self) -> None:
        """The run from its checkpoint (checkpoint.pt, or the newest intact kept copy); every rank reads it."""
        path, fallback = self.run_dir.to_resume()
        saved = checkpoint.load(path, self.engine.device)
        self.load_state_dict(saved)
        s = self.state
        if fallback:
            self.log.warning(fallback)
        self.log.print(f"resuming {self.out_dir} at step {s.step} (epoch {s.epoch + 1}, step {s.step_in_epoch} of the epoch)")
        if self.engine.rank == 0:
            self.run_dir.preempted_marker.unlink(missing_ok=True)
            # a write cut short by a killed process (not under Horovod Elastic: it may be a running rank 0's)
            for leftover in [] if self.engine.elastic else self.run_dir.partial_checkpoints():
                leftover.unlink(missing_ok=True)
            if not self.engine.elastic and not fallback:  # the copies a run killed after its last write had no time to make
                self._keep_copies(saved)

    # saving --------------------------------------------------------------------------------------
    def save(self, finished: str | None = None, wait: bool = False) -> None:
        """Rank 0 copies the state to host memory and writes it in the background (after the previous
        write is done: at most one in flight); every rank checks its weights (they are the same) and
        learns whether the previous write worked, so all stop together. The last checkpoint of a run
        (`finished`: why the run is over, if it is) and `wait` ones are on disk when this returns."""
        cfg, engine = self.cfg, self.engine
        share_bn_statistics(self.model, engine, cfg.bn_span)
        if self.ema:  # (saved as evaluated)
            share_bn_statistics(self.ema.model, engine, cfg.bn_span)
        s = self.state
        norms = torch.stack(torch._foreach_norm([p.detach() for p in self.model.parameters()]))
        if not bool(norms.isfinite().all()):  # a NaN or inf anywhere makes its tensor's norm non-finite
            raise raised_everywhere(Diverged(f"weights are not finite at step {s.step}; stopped, {self.left_to_continue()}; lower --lr"))
        samples = self.samples_total()
        self.skipped.take(self.setup.loader, "training")  # (kept in the checkpoint: a resume in this epoch counts on from these)
        problem = None
        if engine.rank == 0 and cfg.save_checkpoints:  # (--no-save-checkpoints: nothing written)
            try:
                self.wait_for_write()
                copied = time.time()
                state = host_copy(self.state_dict(samples, finished))
                self.writer.start(self.run_dir.checkpoint, state, s.step, time.time() - copied)
                self.in_flight = {key: value for key, value in state.items() if not isinstance(value, dict)}
                if wait or finished or s.stop or s.epoch >= cfg.epochs:
                    self.wait_for_write()
            except OSError as err:
                problem = (f"could not write {self.run_dir.checkpoint} at step {self.writer.failed_step} "
                           f"({err.strerror or err}); {self.left_to_continue()}; free disk space and start the same "
                           f"command{self.setup.restart_flags} again")
        self.state.last_saved = time.time()
        if engine.any(problem is not None):
            raise raised_everywhere(RunAborted(problem or "rank 0 could not write the checkpoint"))

    def due_by_clock(self) -> bool:
        """--checkpoint-every-minutes reads rank 0's clock, which the ranks agree on at their agreements
        (--checkpoint-every-steps counts steps, alike on every rank)."""
        minutes = self.cfg.checkpoint_every_minutes
        return bool(minutes) and self.engine.rank == 0 and time.time() - self.state.last_saved >= minutes * 60

    def reserve_host_memory(self) -> None:
        """Once, after the first step (the optimizer has its state): the host memory of rank 0's
        checkpoint copies paged in (train/host_memory.py)."""
        if self.host_memory_unreserved and self.engine.rank == 0 and self.cfg.save_checkpoints:
            reserve(self.state_dict())
            self.host_memory_unreserved = False

    def wait_for_write(self) -> None:
        """Until the background write (and the copies of the one before) is done; logs it, or raises its
        failure; then --keep-checkpoints' copies of it start in the background."""
        self.writer.wait()
        if self.writer.last:
            self.log.checkpoint(**self.writer.last)
            self.writer.last = None
        if self.writer.copy_failure:  # (training goes on: checkpoint.pt is on disk)
            self.log.warning(self.writer.copy_failure)
            self.writer.copy_failure = None
        written, self.in_flight = self.in_flight, None
        if written:
            self._keep_copies(written)

    def _keep_copies(self, saved: dict) -> None:
        """--keep-checkpoints: the finished checkpoint.pt (entries `saved`) kept as the epoch's and the best's."""
        if self.cfg.keep_checkpoints:
            self.writer.keep_copies(self.out_dir, saved, self.cfg.keep_checkpoints)

    def left_to_continue(self) -> str:
        """What a stopped run leaves to continue from, for its last line."""
        return self.run_dir.left_to_continue(self.cfg.save_checkpoints)

    def preempt(self) -> None:
        """A stop signal: the checkpoint on disk (and the preemption marker beside it) before any rank
        exits, then Preempted on every rank."""
        self.save(wait=True)
        step, restart_flags = self.state.step, self.setup.restart_flags
        if self.engine.rank == 0 and not self.cfg.save_checkpoints:
            print(f"preempted at step {step}: {self.left_to_continue()}", file=sys.stderr, flush=True)
        elif self.engine.rank == 0:
            self.run_dir.preempted_marker.write_text(f"step {step}\n")
            # said before any rank exits: a launcher tears the other ranks down at the first exit
            print(f"preempted at step {step}: checkpoint written to {self.out_dir}; start the same command"
                  f"{restart_flags} again to continue", file=sys.stderr, flush=True)
        self.engine.barrier()  # nobody exits (and gets the job torn down) before the checkpoint is on disk
        raise Preempted(f"preempted at step {step}")


def crop_trained_last(saved: dict) -> int | None:
    """The training crop size of the last epoch a checkpoint's run trained, under the run's settings then
    (a resume may change --resolution-schedule); None before its first step."""
    run = saved.get("config") or {}
    epoch = saved["epoch"] if saved["step_in_epoch"] else saved["epoch"] - 1  # (at an epoch's end: the one done)
    if epoch < 0 or "image_size" not in run:
        return None
    ramp = resolution_ramp(run.get("resolution_schedule", ""))
    return ramp(epoch) if ramp else run["image_size"]
