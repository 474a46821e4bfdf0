"""The training loop, readable top to bottom: set up (train/startup.py resolves and checks everything
that can fail first, and returns it as one Setup), then for each epoch `train_epoch` and
`end_of_epoch` (evaluate, checkpoint, stop).

What changes during the run comes from the schedule (train/schedule.py), the optimizer from its
factory (train/optim.py), the gradient averaging and the optimizer step from the engine
(train/engines/), and what is logged, and how, from the run log (train/runlog.py). Metrics stay on
the device between logging points; the only host syncs are at log points, epoch ends and evaluations.

What watches or wraps the step from outside (python -m train.bench's timers and profiler trace, the
GPU check's sync check) is a hook given to `run(cfg, hooks=...)` (train/hooks.py), which the loop
calls at named points; Horovod Elastic's commit is given to `Training.run_epochs` (train/elastic.py).
What saves and restores the run is an object Training holds (train/saving.py's Checkpoints). The
step's parts are named ranges of a torch.profiler trace: "data wait" and "forward" here, "backward",
"all-reduce" and "optimizer" in the engine's step (docs/bench.md).
"""
import contextlib
import dataclasses
import gc
import itertools
import logging
import time

import torch
from mlperf_logging.mllog import constants as K
from torch.profiler import record_function

from models import build_model
from train import checkpoint
from train.batches import epoch_split
from train.bnstats import RecentBatches, StepStatistics, recompute_bn_statistics, share_bn_statistics
from train.compiled import compile_in_place, run_shapes
from train.config import Config, ResolvedConfig
from train.ema import WeightAverage
from train.errors import Diverged, Preempted, RunAborted, raised_everywhere
from train.evaluate import evaluate, replicas_differing
from train.hooks import HookList, LoopHooks
from train.meters import LossMeter, SampleLedger, SkippedFiles
from train.optim import build_optimizer
from train.runlog import RunLog, count, progress, run_header
from train.saving import Checkpoints
from train.schedule import EpochClock, EvalPlan, build_schedules
from train.startup import Setup, prepare
from train.stopping import FlagChecks, StopSignal


def run(cfg: Config, hooks: "tuple[LoopHooks, ...]" = (), start=None) -> dict:
    # train/startup.py: everything that can fail, before the run's first step (`start`: whether the run is
    # new, restarted or resumed, where the command decided it already)
    setup = prepare(cfg, start)
    try:
        return _train(Training(setup, hooks))
    finally:  # the run directory is free for the next job however this one ends (a killed one's lock goes stale)
        if setup.lock:
            setup.lock.release()


def _train(training: "Training") -> dict:
    training.start()
    # the run's long-lived objects (model, optimizer, loader) out of the garbage collector's full passes:
    # one of those, set off by a checkpoint's allocations, stalled the step it fell in by ~0.16 s
    gc.freeze()
    try:
        with StopSignal() as stop_signal:
            if training.engine.elastic:  # Horovod Elastic: the same epochs under hvd.elastic.run, with commits
                from train import elastic
                elastic.run_epochs(training, stop_signal)
            else:
                training.run_epochs(stop_signal)
        with training.host_may_read("the end"):
            return training.finish()
    except RunAborted:
        training.log.stop(K.ABORTED)
        raise
    except Preempted:  # every rank is here, past the checkpoint's barrier: the engine ends as after the last step
        training.engine.shutdown()
        raise
    finally:
        training.writer.join()  # a checkpoint still being written reaches the disk before the process ends
        training.log.close()


@dataclasses.dataclass
class RunState:
    """Where the run is: optimizer steps taken, epochs finished and steps into the current one, the
    epoch's samples trained so far, the crop size the last epoch trained at, the streak of non-finite
    losses (on the device), the last evaluation, and whether to stop. A checkpoint holds it
    (train/saving.py)."""
    bad_steps: torch.Tensor
    last_crop: int | None  # (the loader's size to start with; on a resume: the checkpoint's)
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    samples: SampleLedger = dataclasses.field(default_factory=SampleLedger)  # (checkpoints count the epoch's images)
    top1: float | None = None
    top5: float | None = None
    best_top1: float | None = None  # the best evaluation so far, at step best_step (--keep-checkpoints)
    best_step: int | None = None
    reached_target: bool = False
    stop: bool = False
    last_saved: float = 0.0  # when the last checkpoint was saved, or the run started (--checkpoint-every-minutes)


class Training:
    """A run's parts (engine, loader, model, optimizer, precision, schedule, log) and its state; its
    checkpoints (train/saving.py) save and restore them. The settings and the loader are the Setup's,
    read where used (Horovod Elastic's reshare replaces both)."""

    def __init__(self, setup: Setup, hooks: "tuple[LoopHooks, ...]" = ()):
        self.setup, self.hooks = setup, HookList(hooks)
        cfg, engine, loader = setup.cfg, setup.engine, setup.loader
        self.engine, self.precision = engine, setup.precision
        self.out_dir, device = setup.run_dir.path, engine.device
        self.eval_plan = EvalPlan(cfg.eval_every, cfg.eval_offset, cfg.epochs)
        self.log = RunLog(self.out_dir if engine.rank == 0 else None, cfg, self.eval_plan)
        if device.type == "cuda":  # fixed shapes: let cuDNN pick its fastest kernels; TF32 for fp32 matmuls
            torch.backends.cudnn.benchmark = True
            torch.set_float32_matmul_precision("high")
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.arch, loader.num_classes, cfg.zero_init_residual, cfg.channels_last, cfg.blurpool).to(device)
        model = engine.sync_batchnorm(model, cfg.bn_span, cfg.bn_ghost_group)
        optimizer = build_optimizer(cfg, model)
        self.clock = EpochClock.of(cfg, loader.train_images)
        self.lr_schedule, self.plan = build_schedules(cfg, self.clock)
        self.recent = RecentBatches(cfg.bn_recompute_batches)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.state = RunState(bad_steps=torch.zeros((), dtype=torch.int64, device=device), last_crop=cfg.image_size)
        self.writer = checkpoint.Writer()  # rank 0's background checkpoint writes
        self.skipped = SkippedFiles(engine, self.log.warning)
        self.flag_checks = FlagChecks(cfg.stop_check_every)  # the steps where the ranks agree to stop, or to checkpoint
        if setup.init:  # --init-from's weights, checked at start-up; every rank loads the same
            (weights, start_line), setup.init = setup.init, None  # (not held for the whole run once loaded)
            model.load_state_dict({**model.state_dict(), **weights})  # (a new class count: the head stays as built)
            self.log.print(start_line)
        if cfg.compile:  # in place, before the engine wraps it: class and state_dict keys stay (docs/compile.md)
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # (a GPU-less host with nvcc: "No CUDA runtime")
            compile_in_place(model, cfg.compile_mode, run_shapes(cfg, self.plan, engine.world_size))
        self.model, self.optimizer = engine.wrap(model, optimizer)
        # --ema-decay: the average of the weights, the model evaluated and exported (from the broadcast weights on)
        self.ema = WeightAverage.of(cfg, engine.unwrap(self.model), loader.num_classes) if cfg.ema_decay else None
        self.checkpoints = Checkpoints(setup, model=self.model, optimizer=self.optimizer, ema=self.ema, state=self.state,
                                       skipped=self.skipped, flag_checks=self.flag_checks, writer=self.writer, log=self.log)
        self.resumed = cfg.resume  # until the segment's first epoch starts
        if cfg.resume:  # every rank reads the checkpoint (after the engine's broadcast of rank 0's model)
            self.checkpoints.resume()
        self.lr = self.lr_schedule.lr(max(self.state.step, 1))
        self.step_statistics = StepStatistics(engine.unwrap(self.model))  # (--accumulation-steps: BN's, once a step)

    @property
    def cfg(self) -> ResolvedConfig:
        return self.setup.cfg

    @property
    def loader(self):
        return self.setup.loader

    def start(self) -> None:
        cfg, engine, loader, s = self.cfg, self.engine, self.loader, self.state
        header, device_name, layout = run_header(self.setup, cfg, self.precision, self.out_dir)
        self.log.setup(self.setup.started_ms, header, platform=f"{engine.world_size}x{device_name}", ranks=engine.world_size,
                       train_images=loader.train_images, val_images=loader.val_images,
                       precision=self.precision.name, schedule=self.lr_schedule)
        for line in self.setup.warnings:
            self.log.warning(line)
        if engine.wire_note:  # (--fp16-allreduce where it does not simply send fp16)
            self.log.print(engine.wire_note)
        if loader.empty_classes:
            self.log.warning(f"{len(loader.empty_classes)} class folder(s) hold no training images: "
                             f"{', '.join(loader.empty_classes[:5])}", kind="data", empty_classes=loader.empty_classes)
        resumed_at = {"step": s.step, "epoch": s.epoch + s.step_in_epoch / self.clock.steps_in(s.epoch)}
        # (with how the ranks lie on the nodes, from their host names, and what they all train on)
        self.log.run_start(resumed_at if cfg.resume else None, topology=layout and {
            **layout, "hosts": engine.hosts, "sample_list_digest": loader.sample_list_digest})
        self.started = s.last_saved = time.time()  # (--checkpoint-every-minutes counts from the run's start)
        self.first_step = s.step  # where this segment of the run starts (0, or a resume's step)
        s.stop = s.step >= cfg.max_steps > 0
        self.hooks.run_started(self)

    @contextlib.contextmanager
    def host_may_read(self, what: str):
        """A stretch of the run where the host may wait for the device's values (the hooks are told)."""
        self.hooks.reads_start(what)
        try:
            yield
        finally:
            self.hooks.reads_end(what)

    # the epochs ----------------------------------------------------------------------------------
    def run_epochs(self, stop_signal: "StopSignal", commit=None) -> None:
        """The epochs left. `commit`: Horovod Elastic's (train/elastic.py), which the loop calls every
        --commit-every steps and at each epoch's end but the last; None without it."""
        while self.state.epoch < self.cfg.epochs and not self.state.stop:
            self.train_epoch(stop_signal, commit)
            with self.host_may_read("the epoch's end"):
                self.end_of_epoch(commit)
            self.hooks.epoch_done()
        with self.host_may_read("the end"):
            self.check_replicas()

    def train_epoch(self, stop_signal: "StopSignal", commit=None) -> None:
        """The epoch's remaining steps: each batch through the optimizer step and its loss into the
        meters, a logging window every --log-every steps, and between steps what the run does now and
        then (the ranks' agreements, checkpoints, commits)."""
        cfg, s = self.cfg, self.state
        self._follow_epoch_schedule()
        self.log.epoch_start(s.epoch + 1, fresh=s.step_in_epoch == 0)
        self.model.train()
        self.window, self.epoch_meter = LossMeter(self.engine.device), LossMeter(self.engine.device)
        batches = self._epoch_batches()
        for first in batches:  # each step's first batch; the step takes the rest of its batches from the same iterator
            loss = self.train_step(itertools.chain([first], itertools.islice(batches, self.loader.batch_split[1] - 1)))
            self.hooks.step_done(s.step, loss)
            self.window.add(loss)
            self.epoch_meter.add(loss)
            self.checkpoints.reserve_host_memory()
            if s.step % cfg.log_every == 0:
                with self.host_may_read("a logging point"):
                    self._log_window()
            if s.step == cfg.max_steps:
                s.stop = True
                return
            self._between_steps(stop_signal, commit)

    def _epoch_batches(self):
        """The loader's batches from where the epoch stands, on rank 0's progress bar, each asked for
        in the trace's "data wait" range. Before its step each batch's sample positions go into the
        state's samples (checkpoints count the epoch's images), and --bn-recompute-batches keeps a copy
        of the last few."""
        s = self.state
        batches = self.loader.train_batches(s.epoch, s.step_in_epoch, self.plan.augment(s.epoch))
        passes = self.loader.batch_split[1]  # (the bar counts batches, each a global batch's 1/passes)
        batches = iter(progress(batches, (self.loader.steps_per_epoch - s.step_in_epoch) * passes,
                                self.plan.global_batch(s.epoch) // passes, self.engine.rank == 0, f"epoch {s.epoch + 1}"))
        while True:
            self.hooks.batch_asked()
            with record_function("data wait"):
                batch = next(batches, None)
            if batch is None:
                return
            images, labels = batch
            self.hooks.batch_fetched(images, labels)
            s.samples.add(self.loader.last_positions)
            self.recent.add(images)
            yield images, labels

    def _between_steps(self, stop_signal: "StopSignal", commit) -> None:
        """At the ranks' agreement points (train/stopping.py: spaced by what they cost), a stop signal on
        any rank checkpoints and stops the run, and rank 0's clock may call for a checkpoint; checkpoints
        every --checkpoint-every-steps; Horovod Elastic's commits (at an epoch's last step end_of_epoch
        checkpoints and commits)."""
        cfg, s, engine = self.cfg, self.state, self.engine
        stop = late = False
        if self.flag_checks.due(s.step, engine.world_size):
            stop, late = self.flag_checks.exchange(engine, s.step, [stop_signal.raised, self.checkpoints.due_by_clock()])
        if stop:
            with self.host_may_read("a checkpoint"):
                self.checkpoints.preempt()
        if s.step_in_epoch == self.loader.steps_per_epoch:
            return
        if late or (cfg.checkpoint_every_steps and s.step % cfg.checkpoint_every_steps == 0):
            with self.host_may_read("a checkpoint"):
                self.checkpoints.save()
        if commit and s.step % cfg.commit_every == 0:
            with self.host_may_read("a commit"):
                commit()

    def _follow_epoch_schedule(self) -> None:
        """What the schedule sets per epoch for the loader. Progressive resizing: the epoch's training
        crop size. Batch-size control: the epoch's global batch; the loader's per-rank batch (and so
        its steps per epoch) follows. A change is logged."""
        s = self.state
        size = self.plan.image_size(s.epoch)
        if size != self.loader.train_size:
            self.loader.set_image_size(size)
        # said when the size changes from the last epoch trained (on a resume: the checkpoint's), and at every
        # resume into a ramp
        if size != s.last_crop or (self.resumed and self.plan.resolution):
            changed = self.resumed and s.last_crop not in (None, size)
            before = f" ({s.last_crop} px before the resume)" if changed else ""
            self.log.print(f"epoch {s.epoch + 1}: training crops of {size} px{before}")
        s.last_crop, self.resumed = size, False
        global_batch, per_rank, steps = epoch_split(self.cfg, s.epoch)
        if (per_rank, steps) != self.loader.batch_split:  # (a resumed run in a later phase changes without a log line)
            self.loader.set_batch_size(per_rank, steps)
        if s.step_in_epoch == 0 and s.epoch > 0 and global_batch != self.plan.global_batch(s.epoch - 1):
            self.log.batch_change(s.epoch + 1, s.step, global_batch, per_rank, steps)

    def train_step(self, batches) -> torch.Tensor:
        """One optimizer step over `batches` (--accumulation-steps of them: each pass's gradients add up,
        the last pass's backward averages them over the ranks, then the update). Returns the mean loss
        of its batches on the device, 0 when it was not finite (a non-finite loss counts in the streak,
        not in the averages)."""
        s, passes = self.state, self.loader.batch_split[1]
        settings = self.lr_schedule.step_settings(s.step + 1)
        for group in self.optimizer.param_groups:
            group.update(settings)
        self.lr = settings["lr"]
        losses = []
        for index, (images, labels) in enumerate(batches):
            last = index == passes - 1
            if passes > 1:
                self.step_statistics.before_pass(index)
            with contextlib.nullcontext() if last else self.engine.accumulating(self.model, self.optimizer):
                with self.precision.autocast(), record_function("forward"):
                    loss = self.criterion(self.model(images), labels)
                losses.append(loss.detach())
                if passes > 1:  # the mean over the step's batches: the global batch's mean loss, once averaged
                    loss = loss / passes
                if last:
                    self.engine.step(loss, self.optimizer, self.precision)
                else:
                    with record_function("backward"):
                        self.precision.backward(loss)
        if passes > 1:
            self.step_statistics.after_step(passes)
        self.optimizer.zero_grad()  # sets .grad to None (Horovod's wrapper takes no arguments)
        if self.ema:
            self.ema.update()
        loss = (losses[0] if passes == 1 else torch.stack(losses).mean()).float()
        finite = torch.isfinite(loss)
        s.bad_steps = torch.where(finite, 0, s.bad_steps + 1)
        s.step, s.step_in_epoch = s.step + 1, s.step_in_epoch + 1
        return torch.where(finite, loss, 0.0)

    @contextlib.contextmanager
    def steps_aside(self):
        """For a benchmark: yields a function that steps again on one batch (images, labels), each of the
        step's passes on it. On leaving, what the run prints and logs after is put back as it was: its
        position, its LR, the optimizer's settings (each step sets its own step's there) and the loss
        scale. The weights and the optimizer's buffers keep the extra steps."""
        s = self.state
        position, lr, loss_scale = (s.step, s.epoch, s.step_in_epoch, s.bad_steps), self.lr, self.precision.state_dict()
        settings = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        try:
            yield lambda images, labels: self.train_step([(images, labels)] * self.loader.batch_split[1])
        finally:
            s.step, s.epoch, s.step_in_epoch, s.bad_steps = position
            self.lr = lr
            for group, kept in zip(self.optimizer.param_groups, settings):
                group.update(kept)
            self.precision.load_state_dict(loss_scale)

    def end_of_epoch(self, commit=None) -> None:
        """The epoch's figures, then an evaluation when due, a checkpoint when due, and the end."""
        cfg, s, steps_per_epoch = self.cfg, self.state, self.loader.steps_per_epoch
        number = s.epoch + 1  # MLLOG counts epochs from 1
        mean_loss, seconds = self.epoch_meter.mean(self.engine), self.epoch_meter.seconds()
        self.skipped.take(self.loader, "training")
        skipped = len(self.skipped.in_epoch)
        self._check_finite()
        samples = dict(zip(("count", "sum", "sum_sq"), self.checkpoints.samples_total()))
        finished = s.step_in_epoch == steps_per_epoch
        if finished:
            s.epoch, s.step_in_epoch, self.skipped.in_epoch = s.epoch + 1, 0, set()
            s.samples = SampleLedger()
        figures = None
        if self.epoch_meter.steps:  # (none when a run resumes right after an epoch's last step)
            figures = dict(step=s.step, epoch=s.epoch + s.step_in_epoch / steps_per_epoch,
                           images=self.clock.images(s.step), epoch_seconds=round(seconds, 3),
                           img_per_s=round(self._images_of(self.epoch_meter) / seconds, 2), image_size=self.loader.train_size,
                           loss=mean_loss, lr=self.lr, skipped_images=skipped, samples=samples)
        self.log.epoch_end(number, finished, figures)
        last = s.epoch >= cfg.epochs
        if cfg.eval_every and ((finished and self.eval_plan.due(number)) or last or s.stop):
            self.evaluate(number)
        if s.stop or last or (finished and s.epoch % cfg.checkpoint_every == 0):
            self.checkpoints.save("target" if s.reached_target else "epochs" if last else None)
        if commit and not (s.stop or last):
            commit()

    def evaluate(self, epoch: int) -> None:
        evaluated = self.ema.evaluated() if self.ema else self.model  # (--ema-decay: the average)
        if self.cfg.bn_recompute_batches:  # BN without moving averages: the last K batches' statistics
            bare = evaluated if self.ema else self.engine.unwrap(self.model)
            if not recompute_bn_statistics(bare, self.recent.batches, self.engine, self.precision):
                self.log.warning("no training batch since the resume to recompute BatchNorm statistics from; "
                                 "evaluating with the checkpoint's")
        else:
            share_bn_statistics(evaluated, self.engine, self.cfg.bn_span)
        with self.log.evaluation(epoch, self.state.step, self.clock.images(self.state.step)) as record:
            top1, top5, images = evaluate(evaluated, self.loader, self.precision, self.engine, self.cfg.eval_flip)
            record(top1=top1, top5=top5, eval_images=images, skipped_images=len(self.skipped.take(self.loader, "validation")))
        s = self.state
        s.top1, s.top5 = top1, top5
        if s.best_top1 is None or top1 > s.best_top1:  # (a tie keeps the earlier)
            s.best_top1, s.best_step = top1, s.step
        s.reached_target = bool(self.cfg.target_accuracy and top1 >= self.cfg.target_accuracy)
        s.stop = s.stop or s.reached_target

    # Horovod Elastic (train/elastic.py) ----------------------------------------------------------
    def reopen_log(self) -> None:  # (rank 0 moved: the run log is written by whoever is rank 0 now)
        self.log.reopen(self.out_dir if self.engine.rank == 0 else None, self.cfg, self.state.step)

    def check_replicas(self) -> None:
        if self.engine.world_size > 1:  # every rank must end with the model that was saved
            self.log.replicas(self.state.step, self.engine.world_size, replicas_differing(self.model, self.engine))

    def finish(self) -> dict:
        self.checkpoints.wait_for_write()  # (the last checkpoint's copies)
        s, cfg = self.state, self.cfg
        seconds, images = time.time() - self.started, self.clock.images(s.step)
        steps, trained = s.step - self.first_step, images - self.clock.images(self.first_step)
        segment = f"{count(steps, 'step')}, {trained} images in {seconds:.1f} s"
        summary = (f"done: {segment}" if not self.first_step else
                   f"done: step {s.step} ({segment} since the resume at step {self.first_step}; {images} images in all)")
        measured = f"; top-1 {s.top1:.4f}" if s.top1 is not None else ""  # (a run without evaluation: nothing to say)
        self.log.stop(K.SUCCESS if (s.reached_target or not cfg.target_accuracy) else K.ABORTED,
                      f"{summary}{measured}; run directory {self.out_dir}")
        self.engine.shutdown()
        return {"top1": s.top1, "top5": s.top5, "reached_target": s.reached_target, "steps": s.step,
                "images": images, "seconds": seconds, "out_dir": str(self.out_dir)}

    # checks at logging points --------------------------------------------------------------------
    def _log_window(self) -> None:
        """The logging window's figures; the next window starts when they are written."""
        s, window = self.state, self.window
        mean_loss, seconds = window.mean(self.engine), window.seconds()  # host sync, then the clock
        self._check_finite()
        self.log.train_window((s.epoch + 1, s.step_in_epoch, self.loader.steps_per_epoch), seconds / window.steps,
                              step=s.step, epoch=s.epoch + s.step_in_epoch / self.loader.steps_per_epoch,
                              images=self.clock.images(s.step), img_per_s=round(self._images_of(window) / seconds, 2),
                              loss=mean_loss, lr=self.lr, **self.precision.log_fields())
        self.window = LossMeter(self.engine.device)

    def _images_of(self, meter: "LossMeter") -> int:
        """Images of a meter's steps (the last meter.steps steps), over all ranks."""
        return self.clock.images(self.state.step) - self.clock.images(self.state.step - meter.steps)

    def _check_finite(self) -> None:
        """Every rank stops once any rank's streak of non-finite losses reaches the limit."""
        cfg, s = self.cfg, self.state
        if self.engine.any(int(s.bad_steps.item()) >= cfg.max_bad_steps):
            raise raised_everywhere(Diverged(f"loss was not finite for {cfg.max_bad_steps} consecutive steps (at step "
                                        f"{s.step}); stopped, {self.checkpoints.left_to_continue()}; lower --lr"))

