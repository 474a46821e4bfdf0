"""A run's checkpoints: the half of the training loop (train/loop.py's Training, which mixes this class
in) that says what a checkpoint holds, restores a run from one, and saves one, in the background on
rank 0 with every rank learning how the write went, so that all stop together when it failed; and a
preemption's checkpoint, on disk before any rank exits."""
import sys
import time

import torch

from train import checkpoint
from train.bnstats import share_bn_statistics
from train.config import PREEMPTED_MARKER, to_dict
from train.errors import Diverged, Preempted, RunAborted, raised_everywhere
from train.host_memory import host_copy
from train.meters import SampleLedger


class Checkpointing:
    """Training's checkpoints (its engine, model, optimizer, precision, weight average, state, samples trained,
    skipped files, loader, log, writer, settings and run directory)."""

    def _resume(self) -> None:
        path, fallback = checkpoint.to_resume(self.out_dir)  # (checkpoint.pt, or the newest intact kept copy)
        saved = checkpoint.load(path, self.engine.device)
        self.load_state_dict(saved)
        s = self.state
        if fallback:
            self.log.warning(fallback)
        self.log.print(f"resuming {self.out_dir} at step {s.step} (epoch {s.epoch + 1}, step {s.step_in_epoch} of the epoch)")
        if self.engine.rank == 0:
            (self.out_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
            # a write cut short by a killed process (not under Horovod Elastic: it may be a running rank 0's)
            for leftover in [] if self.engine.elastic else self.out_dir.glob(".checkpoint*.pt.*.tmp"):
                leftover.unlink(missing_ok=True)
            if not self.engine.elastic and not fallback:  # the copies a run killed after its last write had no time to make
                self._keep_copies(saved)

    def state_dict(self, samples: list[int], finished: str | None = None) -> dict:
        """What a checkpoint (and a Horovod Elastic commit) holds; tensors are the live ones."""
        s = self.state
        return {"model": self.engine.unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                "precision": self.precision.state_dict(), "step": s.step, "epoch": s.epoch,
                "step_in_epoch": s.step_in_epoch, "samples": samples, "finished": finished, "config": to_dict(self.cfg),
                "classes": self.loader.class_names, "best_top1": s.best_top1, "best_step": s.best_step,
                **({"ema": self.ema.state_dict()} if self.ema else {}), **self.skipped.state_dict()}

    def load_state_dict(self, saved: dict, weights: bool = True) -> None:
        if weights:
            self.engine.unwrap(self.model).load_state_dict(saved["model"])
        if self.ema:  # (a run that turns the average on at a resume has none saved: it starts from the weights)
            self.ema.load_state_dict(saved.get("ema"))
        self.optimizer.load_state_dict(saved["optimizer"])
        self.precision.load_state_dict(saved["precision"])
        s = self.state
        s.step, s.epoch, s.step_in_epoch = saved["step"], saved["epoch"], saved["step_in_epoch"]
        s.stop, s.reached_target = s.step >= self.cfg.max_steps > 0, False  # (a rollback may go back before either)
        self.samples_trained = SampleLedger(saved.get("samples", (0, 0, 0)))
        self.flag_checks.restart(s.step)  # (every rank, at the same step: a resume, a rollback, a state sync)
        s.best_top1, s.best_step = saved.get("best_top1"), saved.get("best_step")  # (none in older checkpoints)
        self.skipped.load_state_dict(saved)

    def save(self, finished: str | None = None, wait: bool = False) -> None:
        """Rank 0 copies the state to host memory and writes it in the background (after the previous
        write is done: at most one in flight); every rank checks its weights (they are the same) and
        learns whether the previous write worked, so all stop together. The last checkpoint of a run
        (`finished`: why the run is over, if it is) and `wait` ones are on disk when this returns."""
        share_bn_statistics(self.model, self.engine, self.cfg.bn_span)
        if self.ema:  # (saved as evaluated)
            share_bn_statistics(self.ema.model, self.engine, self.cfg.bn_span)
        s, out_dir = self.state, self.out_dir
        norms = torch.stack(torch._foreach_norm([p.detach() for p in self.model.parameters()]))
        if not bool(norms.isfinite().all()):  # a NaN or inf anywhere makes its tensor's norm non-finite
            raise raised_everywhere(Diverged(f"weights are not finite at step {s.step}; stopped, {self._left_to_continue()}; lower --lr"))
        samples = self.samples_trained.total(self.engine)
        self.skipped.take(self.loader, "training")  # (kept in the checkpoint: a resume in this epoch counts on from these)
        problem = None
        if self.engine.rank == 0 and self.cfg.checkpoints:  # (--no-checkpoints: nothing written)
            try:
                self._wait_for_write()
                copied = time.time()
                state = host_copy(self.state_dict(samples, finished))
                self.writer.start(out_dir / "checkpoint.pt", state, s.step, time.time() - copied)
                self.in_flight = {key: value for key, value in state.items() if not isinstance(value, dict)}
                if wait or finished or s.stop or s.epoch >= self.cfg.epochs:
                    self._wait_for_write()
            except OSError as err:
                problem = (f"could not write {out_dir / 'checkpoint.pt'} at step {self.writer.failed_step} "
                           f"({err.strerror or err}); {self._left_to_continue()}; free disk space and start the same "
                           f"command{self.restart_flags} again")
        self.last_checkpoint = time.time()
        if self.engine.any(problem is not None):
            raise raised_everywhere(RunAborted(problem or "rank 0 could not write the checkpoint"))

    def _wait_for_write(self) -> None:
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

    def _left_to_continue(self) -> str:
        return checkpoint.left_to_continue(self.out_dir, self.cfg.checkpoints)

    def _preempt(self) -> None:
        self.save(wait=True)
        step = self.state.step
        if self.engine.rank == 0 and not self.cfg.checkpoints:
            print(f"preempted at step {step}: {self._left_to_continue()}", file=sys.stderr, flush=True)
        elif self.engine.rank == 0:
            (self.out_dir / PREEMPTED_MARKER).write_text(f"step {step}\n")
            # said before any rank exits: a launcher tears the other ranks down at the first exit
            print(f"preempted at step {step}: checkpoint written to {self.out_dir}; start the same command"
                  f"{self.restart_flags} again to continue", file=sys.stderr, flush=True)
        self.engine.barrier()  # nobody exits (and gets the job torn down) before the checkpoint is on disk
        raise Preempted(f"preempted at step {step}")
