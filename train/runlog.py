"""What a run leaves behind and prints: mllog.txt (MLLOG lines via mlperf_logging), metrics.jsonl
(one JSON object per logging point) and human lines on stdout. Only rank 0 writes.

The loop says what happened (setup, run_start, epoch_start, train_window, epoch_end, evaluation,
replicas, stop); this module decides how each is logged: the MLLOG keys and intervals (blocks run
from the epoch after one evaluation to the next), the JSON-lines records and the printed lines.
"""
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from mlperf_logging.mllog import constants as K
from mlperf_logging.mllog.mllog import MLLogger

from data.progress import clock_time
from train.rundir import RunDir


class RunLog:
    """`seconds` in metrics.jsonl is training time: it runs from the first segment's run_start and
    goes on from where the last segment stopped when a run is resumed (downtime excluded); a
    `resume` record marks each new segment with the wall-clock gap."""

    def __init__(self, out_dir: Path | None, cfg, eval_plan):
        """out_dir None: a silent log (ranks other than 0)."""
        self.enabled, self.cfg, self.eval_plan = out_dir is not None, cfg, eval_plan
        self.mllog, self.tensorboard, self.out_dir = None, None, out_dir
        self._started, self._offset, self._previous = time.time(), 0.0, {}
        self.accumulation_steps = max(cfg.accumulation_steps, 1)  # as MLLOG said last
        if not self.enabled:
            return
        logger = logging.getLogger(f"trainer.mllog.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        run_dir = RunDir(out_dir)
        self._handler = logging.FileHandler(run_dir.mllog)
        logger.addHandler(self._handler)
        self.mllog = MLLogger(logger=logger, default_stack_offset=2)
        self._previous = _previous_segment(run_dir.metrics)
        self._metrics = open(run_dir.metrics, "a", buffering=1)

    def reopen(self, out_dir: Path | None, cfg, step: int) -> None:
        """Horovod Elastic moved rank 0: this log is written by whoever is rank 0 now (out_dir None:
        silent), under the settings of the new worker count, going on from `step`; whoever holds it keeps
        the same object."""
        self.close()
        self.__init__(out_dir, cfg, self.eval_plan)
        self.take_over(step)

    def take_over(self, step: int) -> None:
        """Horovod Elastic made this worker rank 0 in the middle of the run, going on from `step`: it
        continues the files, the TensorBoard curves and the training clock where they end."""
        self._offset, self._started = float(self._previous.get("seconds", 0.0)), time.time()
        self._open_tensorboard(step)

    def _open_tensorboard(self, resumed_step: int | None) -> None:
        if self.enabled and self.cfg.tensorboard and self.tensorboard is None:
            self.tensorboard = TensorBoard(RunDir(self.out_dir).tensorboard, resumed_step)

    def workers(self, step: int, ranks: int, per_rank: int, steps: int = 1) -> None:
        """Horovod Elastic changed the workers; the run goes on from its commit at `step`."""
        self._accumulation(steps)
        self.metrics(kind="workers", step=step, ranks=ranks, batch_size=per_rank, accumulation_steps=steps,
                     seconds=self.seconds())
        self.print(f"workers changed: {ranks} rank(s) x batch {per_rank}{accumulated(steps)}, from the commit at step {step}")

    # what happened -------------------------------------------------------------------------------
    def setup(self, init_start_ms: int, header: str, *, platform: str, ranks: int, train_images: int, val_images: int,
              precision: str, schedule) -> None:
        """The run's settings: MLLOG's init_start (taken before any set-up work) and keys, and the header
        (run_header's lines)."""
        cfg = self.cfg
        self._start(K.INIT_START, time_ms=init_start_ms)
        for key, value in [
            (K.SUBMISSION_BENCHMARK, K.RESNET), (K.SUBMISSION_DIVISION, cfg.division),
            (K.SUBMISSION_ORG, cfg.submission_org), (K.SUBMISSION_STATUS, "research"),
            (K.SUBMISSION_PLATFORM, cfg.submission_platform or platform), (K.CACHE_CLEAR, True), (K.SEED, cfg.seed),
            (K.GLOBAL_BATCH_SIZE, cfg.global_batch_size), (K.GRADIENT_ACCUMULATION_STEPS, max(cfg.accumulation_steps, 1)),
            (K.TRAIN_SAMPLES, train_images), (K.EVAL_SAMPLES, val_images),
            (K.MODEL_BN_SPAN, min(cfg.bn_group_size or cfg.batch_size, cfg.batch_size) * cfg.bn_span), (K.OPT_NAME, cfg.optimizer),
            *_optimizer_keys(cfg, schedule), ("label_smoothing", cfg.label_smoothing), ("precision", precision),
        ]:
            self._event(key, value)
        self.print(header)

    def warning(self, line: str, **record) -> None:
        self.print(f"warning: {line}")
        if record:
            self.metrics(**record)

    def run_start(self, resumed_at: dict | None = None, topology: dict | None = None) -> None:
        """Set-up is over: MLLOG's run_start, and the run's clock; `resumed_at` ({step, epoch}) marks
        a resumed segment; `topology` (the nodes and the sample list) is this segment's record of them."""
        self._end(K.INIT_STOP)
        self._start(K.RUN_START)
        self._started = time.time()
        last = self._previous
        self._offset = float(last.get("seconds", 0.0)) if resumed_at else 0.0
        if resumed_at:
            gap = round(self._started - last["time"], 3) if "time" in last else None
            self.metrics(kind="resume", **resumed_at, seconds=round(self._offset, 3), gap_s=gap)
        if topology:
            self.metrics(kind="topology", step=resumed_at["step"] if resumed_at else 0, **topology,
                         seconds=round(self._offset, 3))
        self._open_tensorboard(resumed_at["step"] if resumed_at else None)

    def epoch_start(self, epoch: int, fresh: bool) -> None:
        """Epoch `epoch` (from 1) begins; `fresh`: at its first step (not a resumed middle)."""
        if fresh and self.eval_plan.starts_block(epoch):
            self._start(K.BLOCK_START, first_epoch_num=epoch,
                        epoch_count=self.eval_plan.next_eval(epoch) - epoch + 1)
        self._start(K.EPOCH_START, epoch_num=epoch)

    def train_window(self, at: tuple[int, int, int], step_s: float, **record) -> None:
        """A logging window of training steps (record: step, epoch, images, img_per_s, loss, lr, ...),
        ending at step `at[1]` of epoch `at[0]`'s `at[2]`, `step_s` seconds a step. Where no terminal
        shows the progress bar (a batch job's output file, a pipe), a line says so with the epoch's ETA."""
        self.metrics(kind="train", **record, seconds=self.seconds())
        if self.enabled and not interactive():
            epoch, done, steps = at
            self.print(f"train {epoch:3d}/{self.cfg.epochs}  step {done:{len(str(steps))}d}/{steps}  {record['img_per_s']:8.1f} img/s  "
                       f"loss {record['loss']:.4f}  lr {record['lr']:.4g}  ETA {clock_time((steps - done) * step_s)}")

    def checkpoint(self, step: int, copy_s: float, write_s: float, started: float) -> None:
        """A checkpoint reached the disk: `copy_s` on the training thread (to host memory), `write_s`
        in the background from wall-clock time `started`."""
        self.metrics(kind="checkpoint", step=step, copy_s=copy_s, write_s=write_s, started=started,
                     seconds=self.seconds())

    def epoch_end(self, epoch: int, finished: bool, figures: dict | None) -> None:
        """The epoch's figures (None when this segment trained none of its steps); `finished`: its last step done."""
        if finished:
            self._end(K.EPOCH_STOP, epoch_num=epoch)
        if figures:
            self.metrics(kind="epoch", **figures, seconds=self.seconds())
            self.print(f"epoch {epoch:3d}/{self.cfg.epochs}  step {figures['step']:6d}  {figures['epoch_seconds']:7.1f} s  "
                       f"{figures['img_per_s']:8.1f} img/s  loss {figures['loss']:.4f}  lr {figures['lr']:.4g}")

    @contextlib.contextmanager
    def evaluation(self, epoch: int, step: int, images: int):
        """Around an evaluation after `step` steps and `images` training images: yields a function
        taking its figures (top1, top5, eval_images, ...). Its record holds the crop size and flips it
        ran with (a resume may change them; the scorer counts each evaluation's work from its record)."""
        self._start(K.EVAL_START, epoch_num=epoch)
        started = time.time()
        figures = {}
        yield figures.update
        seconds = time.time() - started
        self._end(K.EVAL_STOP, epoch_num=epoch)
        self._event(K.EVAL_ACCURACY, figures["top1"], epoch_num=epoch)
        self._end(K.BLOCK_STOP, first_epoch_num=self.eval_plan.block_start(epoch))
        self.metrics(kind="eval", step=step, epoch=epoch, images=images,
                     seconds=self.seconds(), top1=round(figures["top1"], 5), top5=round(figures["top5"], 5),
                     eval_images=figures["eval_images"], eval_seconds=round(seconds, 3),
                     skipped_images=figures["skipped_images"],
                     eval_image_size=self.cfg.eval_image_size or self.cfg.image_size, eval_flip=bool(self.cfg.eval_flip))
        self.print(f"eval  {epoch:3d}/{self.cfg.epochs}  top-1 {figures['top1']:.4f}  top-5 {figures['top5']:.4f}  "
                   f"({figures['eval_images']} images, {seconds:.1f} s)")

    def batch_change(self, epoch: int, step: int, global_batch: int, per_rank: int, steps: int = 1) -> None:
        """Batch-size control: the global batch from this epoch on (the first epoch's is the setup's
        global_batch_size), and the accumulation steps where they change with it."""
        self._event(K.GLOBAL_BATCH_SIZE, global_batch, epoch_num=epoch)
        self._accumulation(steps, epoch_num=epoch)
        self.metrics(kind="batch", step=step, epoch=epoch, global_batch=global_batch, batch_size=per_rank,
                     accumulation_steps=steps)
        self.print(f"epoch {epoch}: global batch {global_batch} ({per_rank} per rank{accumulated(steps)})")

    def _accumulation(self, steps: int, **metadata) -> None:
        """MLLOG's gradient_accumulation_steps again where it changes (a batch phase, new workers)."""
        if steps != self.accumulation_steps:
            self._event(K.GRADIENT_ACCUMULATION_STEPS, steps, **metadata)
            self.accumulation_steps = steps

    def replicas(self, step: int, ranks: int, differing: int) -> None:
        self.metrics(kind="replicas", step=step, ranks=ranks, differing_from_rank0=differing)
        if differing:
            self.warning(f"{differing} rank(s) ended with a model that differs from rank 0's")

    def stop(self, status: str, summary: str | None = None) -> None:
        """MLLOG's run_stop with its status (success, aborted), and the closing line."""
        self._end(K.RUN_STOP, status=status)
        if summary:
            self.print(summary)

    # how --------------------------------------------------------------------------------------------
    def seconds(self) -> float:
        """Training seconds since the run's first start, downtime between segments excluded."""
        return round(self._offset + time.time() - self._started, 3)

    def metrics(self, **record) -> None:
        if self.enabled:
            record["time"] = round(time.time(), 3)
            self._metrics.write(json.dumps(record) + "\n")
            if self.tensorboard:
                self.tensorboard.add(record)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.enabled:
            self._metrics.close()
            self._handler.close()
            if self.tensorboard:
                self.tensorboard.close()

    def _event(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self.mllog.event(key=key, value=value, metadata=metadata or None)

    def _start(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self.mllog.start(key=key, value=value, metadata=metadata or None)

    def _end(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self.mllog.end(key=key, value=value, metadata=metadata or None)


class TensorBoard:
    """The train, epoch and eval records of metrics.jsonl as TensorBoard scalars (`kind/field`, at the
    record's optimizer step and wall-clock time). A resumed segment purges what an earlier one logged
    after the step it resumes from (a killed segment logs past its last checkpoint), so each curve
    goes on from there once."""
    SCALARS = {"train": ("img_per_s", "loss", "lr", "loss_scale"), "epoch": ("img_per_s", "loss", "lr"),
               "eval": ("top1", "top5")}

    def __init__(self, folder: Path, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(folder), purge_step=None if resumed_step is None else resumed_step + 1)

    def add(self, record: dict) -> None:
        for name in self.SCALARS.get(record["kind"], ()):
            if name in record:
                self.writer.add_scalar(f"{record['kind']}/{name}", record[name], record["step"], walltime=record["time"])

    def close(self) -> None:
        self.writer.close()


def _optimizer_keys(cfg, schedule) -> list[tuple[str, object]]:
    """MLPerf's optimizer keys: lars_opt_* for LARS, sgd_opt_* (and opt_*) for the others."""
    prefix = "lars_opt" if cfg.optimizer == "lars" else "sgd_opt"
    keys = [(f"{prefix}_base_learning_rate", cfg.lr)]
    keys += [(f"{prefix}_{name}", value) for name, value in schedule.mllog_settings().items()]
    keys += [(f"{prefix}_momentum", cfg.momentum), (f"{prefix}_weight_decay", cfg.weight_decay)]
    if cfg.optimizer == "lars":
        return keys + [(K.LARS_EPSILON, cfg.lars_epsilon), (K.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS, cfg.warmup_epochs),
                       ("lars_opt_trust_coefficient", cfg.lars_eta)]
    return keys + [(K.OPT_LR_WARMUP_EPOCHS, cfg.warmup_epochs)]


def _previous_segment(path: Path) -> dict:
    """Where a resumed run's metrics.jsonl left off: the training `seconds` of its last record that has
    them (not every kind does) and the wall-clock `time` of its last complete line."""
    found: dict = {}
    lines = reversed(path.read_text(errors="replace").splitlines()) if path.is_file() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a crash
            continue
        found.setdefault("time", record.get("time"))
        if "seconds" in record:
            found["seconds"] = record["seconds"]
            break
    return {key: value for key, value in found.items() if value is not None}


def interactive() -> bool:
    """A person at a terminal sees the output (stdout and stderr both on one): a progress bar then,
    plain lines otherwise."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def progress(batches, steps: int, images_per_step: int, enabled: bool, desc: str):
    """On a terminal, the batches through a tqdm bar that counts images (so its rate is images/s over
    all ranks), each step's once it is done; elsewhere the batches as they are (RunLog.train_window
    prints a line every --log-every steps instead)."""
    if not enabled or not interactive():
        return batches
    from tqdm import tqdm
    bar = tqdm(total=steps * images_per_step, desc=desc, unit="img", unit_scale=True, leave=False, dynamic_ncols=True)

    def counted():
        try:
            for batch in batches:
                yield batch
                bar.update(images_per_step)
        finally:
            bar.close()
    return counted()


def run_header(setup, cfg, precision, out_dir: Path) -> tuple[str, str, dict]:
    """The run's first line (the model and data, ranks and batch, optimizer and LR schedule, training
    crops and evaluation, precision and threads, loader, run directory) with the lines on what a
    continued run kept of its batch below it (batch_kept), the device's name, and how the ranks lie on
    the nodes (from their host names)."""
    import platform
    import torch
    from train.device_choices import loader_summary
    from train.engines.topology import node_summary
    engine, loader, notes = setup.engine, setup.loader, setup.notes
    device = engine.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    where, layout = node_summary(engine.hosts) if engine.hosts else ("", {})  # (Horovod Elastic: no hosts)
    batch_note = f" ({notes['batch']})" if notes.get("batch") else ""
    lr_notes = [note for note in (preset_lr_note(cfg), notes.get("lr")) if note]
    lr_note = f" ({'; '.join(lr_notes)})" if lr_notes else ""
    compiled = f" compiled ({cfg.compile_mode})" if cfg.compile else ""
    schedule = f", then epochs:batch {cfg.batch_schedule}" if cfg.batch_schedule else ""
    header = " | ".join([
        f"training {model_summary(cfg)} on {setup.data_dir or 'synthetic data'}: {loader.num_classes} classes, "
        f"{loader.train_images} train / {loader.val_images} val images",
        f"{where if engine.world_size > 1 else ''}{engine.world_size} rank(s) x batch {cfg.batch_size}"
        f"{accumulated(cfg.accumulation_steps)} = global batch {cfg.global_batch_size}{batch_note}{schedule}",
        f"{cfg.optimizer} lr {cfg.lr:g}, warmup {cfg.warmup_epochs:g} epochs{lr_note}, then {decay_summary(cfg)}",
        crops_summary(cfg, notes.get("crops", "")),
        f"{precision.name}{compiled}{precision.source.removeprefix(precision.name)}, "
        f"{count(torch.get_num_threads(), 'thread')}",  # (what the precision follows)
        loader_summary(cfg.loader, cfg.dali_decode, cfg.workers, device),
        str(out_dir)])
    return "\n".join([header, *batch_kept(setup.start, cfg, engine.world_size, out_dir)]), device_name, layout


def batch_kept(start, cfg, ranks: int, out_dir) -> list[str]:
    """A continued run's batch on this rank count (`start`: rundir.Start): its per-rank batch kept with
    other accumulation steps (a line), and a restart's --batch-size or --accumulation-steps that the
    run's own override (a warning)."""
    saved, command = (start.saved_batch, start.command_batch) if start else ((), ())
    split, lines = f"{cfg.batch_size} per rank{accumulated(cfg.accumulation_steps)}", []
    if saved and saved[0] == cfg.batch_size and saved[1] != cfg.accumulation_steps:
        before = cfg.global_batch_size // (saved[0] * saved[1])
        lines.append(f"global batch {cfg.global_batch_size} kept on {ranks} rank(s) as {split} (was {before} rank(s) x "
                     f"{saved[1]} accumulated): the same run, the per-rank batch unchanged")
    not_taken = [f"{flag} {value}" for flag, value, resolved in zip(("--batch-size", "--accumulation-steps"), command,
                                                                 (cfg.batch_size, cfg.accumulation_steps)) if value and value != resolved]
    if not_taken:
        lines.append(f"warning: {' and '.join(not_taken)} not taken: {out_dir} holds a run of global batch "
                     f"{cfg.global_batch_size}, kept on {ranks} rank(s) as {split}; change it with --resume --global-batch-size")
    return lines


def accumulated(steps: int) -> str:
    """' x N accumulated' for gradient accumulation over N > 1 batches per step, else ''."""
    return f" x {steps} accumulated" if steps > 1 else ""


def model_summary(cfg) -> str:
    """The architecture, and what changes the model trained or evaluated: BlurPool, the average of the weights."""
    parts = [cfg.arch]
    if cfg.blurpool:
        parts.append("BlurPool")
    if cfg.ema_decay:
        parts.append(f"weight average (decay {cfg.ema_decay:g})")
    return " + ".join(parts)


def preset_lr_note(cfg) -> str:
    """What the header says when the peak LR is the preset's own, set for a global batch other than the
    run's (a --batch-size or --global-batch-size on the command line changes the batch, not the
    preset's LR; train/cli.py parse records the preset's batch); "" otherwise."""
    batch = cfg.preset_lr_batch
    if not batch or batch == cfg.global_batch_size:
        return ""
    return (f"the preset's lr {cfg.lr:g} is for global batch {batch}, not {cfg.global_batch_size}; "
            "give --lr or --lr-per-256 to change it")


def decay_summary(cfg) -> str:
    """How --lr-schedule moves the LR after the warmup, in a few words that name it."""
    return {"warmup-poly": f"poly decay (power {cfg.lr_decay_power:g}) to {cfg.end_lr:g}",
            "cosine": "cosine to 0", "linear": "linear to 0",
            "multistep": f"multistep x{cfg.lr_decay_factor:g} after epochs {cfg.lr_decay_epochs}",
            "phases": f"phases (epochs:factor) {cfg.lr_phases}"}.get(cfg.lr_schedule, cfg.lr_schedule)


def crops_summary(cfg, note: str = "") -> str:
    """The training crops (a size, or --resolution-schedule's ramp) with start-up's `note` on them, and
    the evaluation where it is not a plain centre crop at the training size (its size always beside a
    ramp: it is --image-size's, which no training epoch may have)."""
    from train.crops import resolution_ramp
    ramp = resolution_ramp(cfg.resolution_schedule)
    crops = f"crops {ramp.start} to {ramp.end} px" if ramp else f"crops {cfg.image_size} px"
    crop_notes = ([f"ramp {cfg.resolution_schedule}"] if ramp else []) + ([note] if note else [])
    if crop_notes:
        crops += f" ({'; '.join(crop_notes)})"
    evaluated = cfg.eval_image_size or cfg.image_size
    size = f" at {evaluated} px" if ramp or evaluated != cfg.image_size else ""
    flips = " with flips" if cfg.eval_flip else ""
    return f"{crops}, eval{size}{flips}" if size or flips else crops


def count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"
