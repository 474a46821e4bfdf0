"""The training loop, readable top to bottom: set up, then epochs of steps, evals and checkpoints.

Metrics stay on the device between logging points; the only host syncs are at log points,
epoch ends and evaluations.
"""
import dataclasses
import hashlib
import platform
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import yaml
from mlperf_logging.mllog import constants as K

from data import DataError, build_loader
from data.embedded import ensure_embedded
from models import build_model
from train import checkpoint, engines
from train.config import PREEMPTED_MARKER, Config, UsageError, to_dict
from train.lars import LARS, lars_param_groups
from train.precision import Precision
from train.rules import batch_sizes, lr_and_warmup
from train.runlog import RunLog, progress
from train.schedule import WarmupPolySchedule

RUN_FILES = ("checkpoint.pt", "mllog.txt", "metrics.jsonl")


class RunAborted(RuntimeError):
    """The run stopped itself cleanly (MLLOG status aborted) and kept its last good checkpoint."""


class Diverged(RunAborted):
    """The loss stayed non-finite."""


class RunFinished(Exception):
    """The run in --out-dir has nothing left to do: said in one line, its files untouched, exit 0."""


class Preempted(Exception):
    """SIGUSR1/SIGTERM arrived: the checkpoint is written (and rank 0 said so) and the next start
    resumes by itself."""


class StopSignal:
    """Remembers a SIGUSR1 or SIGTERM (Slurm's warning before the time limit, a scheduler's stop) or
    a SIGINT (Ctrl-C): the run checkpoints and stops at the ranks' next agreement. A second Ctrl-C
    stops at once."""
    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.raised = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame):
        self.raised = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def run(cfg: Config) -> dict:
    init_start_ms = int(time.time() * 1000)
    engine = _create_engine(cfg)
    device = engine.device
    # every check that can fail runs on every rank before the run directory exists
    cfg, loader, precision, data_dir, choice_note = _agreed(engine, lambda: _prepare(cfg, engine))
    out_dir = _agreed(engine, lambda: _make_out_dir(cfg, engine))
    cfg = dataclasses.replace(cfg, out_dir=str(out_dir))
    log = RunLog(out_dir if engine.rank == 0 else None)

    if device.type == "cuda":  # fixed shapes: let cuDNN pick its fastest kernels; TF32 for fp32 matmuls
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.arch, loader.num_classes, cfg.zero_init_residual, cfg.channels_last).to(device)
    model = engine.sync_batchnorm(model, cfg.bn_span)
    global_batch, base_lr = cfg.global_batch_size, cfg.lr
    optimizer = _optimizer(cfg, model, base_lr)
    steps_per_epoch = loader.steps_per_epoch
    schedule = WarmupPolySchedule(base_lr, round(cfg.warmup_epochs * steps_per_epoch),
                                  cfg.epochs * steps_per_epoch, cfg.end_lr, cfg.lr_decay_power)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    step, epoch, step_in_epoch = 0, 0, 0
    if cfg.resume:
        state = checkpoint.load(out_dir / "checkpoint.pt", device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        precision.load_state_dict(state["precision"])
        step, epoch, step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        log.print(f"resuming {out_dir} at step {step} (epoch {epoch + 1}, step {step_in_epoch} of the epoch)")
        if engine.rank == 0:
            (out_dir / PREEMPTED_MARKER).unlink(missing_ok=True)
    model, optimizer = engine.wrap(model, optimizer)

    _log_setup(log, cfg, engine, precision, loader, global_batch, base_lr, schedule, init_start_ms)
    log.print(f"training {cfg.arch} on {data_dir or 'synthetic data'}: {loader.num_classes} classes, "
              f"{loader.train_images} train / {loader.val_images} val images | {engine.world_size} rank(s) x batch "
              f"{cfg.batch_size} = global batch {global_batch} | {cfg.optimizer} lr {base_lr:g}, warmup "
              f"{cfg.warmup_epochs:g} epochs{f' ({choice_note})' if choice_note else ''} | {precision.name} on "
              f"{device.type} | {out_dir}")
    if loader.empty_classes:
        log.print(f"warning: {len(loader.empty_classes)} class folder(s) hold no training images: "
                  f"{', '.join(loader.empty_classes[:5])}")
        log.metrics(kind="data", empty_classes=loader.empty_classes)
    log.end(K.INIT_STOP)
    log.start(K.RUN_START)
    log.start_clock({"step": step, "epoch": epoch + step_in_epoch / steps_per_epoch} if cfg.resume else None)
    run_start = time.time()

    result = {"top1": None, "top5": None, "reached_target": False}
    bad_steps = torch.zeros((), dtype=torch.int64, device=device)  # consecutive non-finite losses
    stop = step >= cfg.max_steps > 0
    stop_signal = StopSignal()
    try:
        while epoch < cfg.epochs and not stop:
            epoch_number = epoch + 1  # MLLOG counts epochs from 1
            if step_in_epoch == 0 and _first_of_block(cfg, epoch_number):
                log.start(K.BLOCK_START, first_epoch_num=epoch_number,
                          epoch_count=_next_eval_epoch(cfg, epoch_number) - epoch_number + 1)
            log.start(K.EPOCH_START, epoch_num=epoch_number)
            model.train()
            window, epoch_meter = LossMeter(device), LossMeter(device)
            batches = progress(loader.train_batches(epoch, step_in_epoch), steps_per_epoch - step_in_epoch,
                               engine.rank == 0, f"epoch {epoch_number}")
            lr = schedule(max(step, 1))  # a run stopped after an epoch's last step resumes into its end
            for images, labels in batches:
                lr = schedule(step + 1)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                with precision.autocast():
                    loss = criterion(model(images), labels)
                precision.backward_and_step(loss, optimizer)
                optimizer.zero_grad()  # sets .grad to None (Horovod's wrapper takes no arguments)
                loss = loss.detach().float()
                finite = torch.isfinite(loss)
                bad_steps = torch.where(finite, 0, bad_steps + 1)
                loss = torch.where(finite, loss, 0.0)  # a non-finite loss is counted, not averaged in
                window.add(loss)
                epoch_meter.add(loss)
                step, step_in_epoch = step + 1, step_in_epoch + 1
                if step % cfg.log_every == 0:
                    mean_loss, seconds = window.mean(engine), window.seconds()  # host sync, then the clock
                    _check_finite(bad_steps, cfg, step, out_dir, engine)
                    log.metrics(kind="train", step=step, epoch=epoch + step_in_epoch / steps_per_epoch,
                                images=step * global_batch, seconds=log.seconds(),
                                img_per_s=round(window.steps * global_batch / seconds, 2), loss=mean_loss, lr=lr,
                                **precision.log_fields())
                    window = LossMeter(device)
                if step == cfg.max_steps:
                    stop = True
                    break
                if (engine.world_size == 1 or step % cfg.stop_check_every == 0) and engine.any(stop_signal.raised):
                    _save(out_dir, model, optimizer, precision, cfg, step, epoch, step_in_epoch, engine)
                    if engine.rank == 0:
                        (out_dir / PREEMPTED_MARKER).write_text(f"step {step}\n")
                        # said before any rank exits: a launcher tears the other ranks down at the first exit
                        print(f"preempted at step {step}: checkpoint written to {out_dir}; start the same command "
                              "again to continue", file=sys.stderr, flush=True)
                    engine.barrier()  # nobody exits (and gets the job torn down) before the checkpoint is on disk
                    raise Preempted(f"preempted at step {step}")
            mean_loss, epoch_seconds = epoch_meter.mean(engine), epoch_meter.seconds()
            skipped = _report_skipped(loader, engine, log, "training")
            _check_finite(bad_steps, cfg, step, out_dir, engine)
            finished_epoch = step_in_epoch == steps_per_epoch
            if finished_epoch:
                log.end(K.EPOCH_STOP, epoch_num=epoch_number)
                epoch, step_in_epoch = epoch + 1, 0
            if epoch_meter.steps:  # (none when a run resumes right after an epoch's last step)
                img_per_s = epoch_meter.steps * global_batch / epoch_seconds
                log.metrics(kind="epoch", step=step, epoch=epoch if finished_epoch else epoch + step_in_epoch / steps_per_epoch,
                            images=step * global_batch, seconds=log.seconds(), epoch_seconds=round(epoch_seconds, 3),
                            img_per_s=round(img_per_s, 2), loss=mean_loss, lr=lr, skipped_images=skipped)
                log.print(f"epoch {epoch_number:3d}/{cfg.epochs}  step {step:6d}  {epoch_seconds:7.1f} s  "
                          f"{img_per_s:8.1f} img/s  loss {mean_loss:.4f}  lr {lr:.4g}")

            last_epoch = epoch >= cfg.epochs
            if cfg.eval_every and ((finished_epoch and _eval_due(cfg, epoch_number)) or last_epoch or stop):
                _evaluate_and_log(model, loader, precision, engine, log, cfg, epoch_number, step, global_batch, result)
                stop = stop or result["reached_target"]
            if stop or last_epoch or (finished_epoch and epoch % cfg.checkpoint_every == 0):
                finished = "target" if result["reached_target"] else "epochs" if last_epoch else None
                _save(out_dir, model, optimizer, precision, cfg, step, epoch, step_in_epoch, engine, finished)
        if engine.world_size > 1:  # every rank must end with the model that was saved
            differing = replicas_differing(model, engine)
            log.metrics(kind="replicas", step=step, ranks=engine.world_size, differing_from_rank0=differing)
            if differing:
                log.print(f"warning: {differing} rank(s) ended with a model that differs from rank 0's")
    except RunAborted:
        log.end(K.RUN_STOP, status=K.ABORTED)
        raise
    finally:
        stop_signal.restore()
        log.close()

    status = K.SUCCESS if (result["reached_target"] or not cfg.target_accuracy) else K.ABORTED
    log.end(K.RUN_STOP, status=status)
    total_seconds = time.time() - run_start
    log.print(f"done: {step} steps, {step * global_batch} images in {total_seconds:.1f} s; top-1 "
              f"{result['top1'] if result['top1'] is None else round(result['top1'], 4)}; run directory {out_dir}")
    engine.shutdown()
    return {**result, "steps": step, "images": step * global_batch, "seconds": total_seconds, "out_dir": str(out_dir)}


def test_only(cfg: Config) -> tuple[float, float, int]:
    """`--test-only`: the checkpoint in --out-dir evaluated over the validation set of its run's data
    (or --data-dir), on any engine and rank count; nothing in the run directory changes."""
    engine = _create_engine(cfg)

    def prepare():
        run_dir = Path(cfg.out_dir)
        if not (run_dir / "checkpoint.pt").is_file():
            raise UsageError(f"{run_dir} holds no checkpoint.pt to evaluate; check --out-dir")
        precision = Precision(cfg.precision, engine.device)
        batch = cfg.batch_size or max(1, cfg.global_batch_size // engine.world_size) or 256
        data_dir = cfg.data_dir or (str(ensure_embedded()) if cfg.loader != "synthetic" else "")
        loader = build_loader(dataclasses.replace(cfg, data_dir=data_dir, batch_size=batch, global_batch_size=0),
                              engine.rank, engine.world_size, engine.device)
        state = checkpoint.load(run_dir / "checkpoint.pt", engine.device)
        if state["model"]["fc.weight"].shape[0] != loader.num_classes:
            raise UsageError(f"the checkpoint in {run_dir} has {state['model']['fc.weight'].shape[0]} classes, the "
                             f"data {data_dir or 'synthetic'} {loader.num_classes}; check --data-dir")
        return precision, loader, state
    precision, loader, state = _agreed(engine, prepare)
    model = build_model(cfg.arch, loader.num_classes, channels_last=cfg.channels_last).to(engine.device)
    model.load_state_dict(state["model"])
    top1, top5, images = evaluate(model, loader, precision, engine)
    if engine.rank == 0:
        print(f"top-1 {top1:.4f}  top-5 {top5:.4f}  ({images} images)", flush=True)
    engine.shutdown()
    return top1, top5, images


class LossMeter:
    """Losses summed on the device since the meter was made; read (one host sync) at logging points."""

    def __init__(self, device: torch.device):
        self.total, self.steps, self.start = torch.zeros((), device=device), 0, time.time()

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.steps += 1

    def mean(self, engine) -> float:
        total = engine.all_reduce_sum(self.total.clone())
        return round(total.item() / (max(self.steps, 1) * engine.world_size), 5)

    def seconds(self) -> float:
        return max(time.time() - self.start, 1e-9)


def _agreed_error(err: Exception) -> Exception:
    """Marks an error that every rank raises alike, so that only rank 0 prints it."""
    err.agreed = True
    return err


def _create_engine(cfg: Config):
    try:
        return engines.create(cfg)
    except UsageError as err:  # decided by the flags and the launcher's environment: alike on every rank
        raise _agreed_error(err)


def _agreed(engine, step):
    """Runs a set-up step on every rank; if it fails on any, every rank raises the first failure
    (rank 0 prints it), so no rank goes on alone and no rank hangs waiting for one that stopped."""
    try:
        value, problem = step(), None
    except (UsageError, DataError, RunFinished) as err:
        value, problem = None, (type(err).__name__, str(err))
    problems = engine.gather_object(problem) if engine.world_size > 1 else [problem]
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        kind = {cls.__name__: cls for cls in (UsageError, DataError, RunFinished)}[first[0]]
        raise _agreed_error(kind(first[1]))
    return value


def _prepare(cfg: Config, engine):
    """The resolved settings and the parts that check the input: (cfg, loader, precision, data dir, note)."""
    precision = Precision(cfg.precision, engine.device)
    batch_size, global_batch = batch_sizes(cfg.batch_size, cfg.global_batch_size, engine.world_size)
    cfg = dataclasses.replace(cfg, batch_size=batch_size, global_batch_size=global_batch)
    lr, warmup, note = lr_and_warmup(cfg, global_batch)
    cfg = dataclasses.replace(cfg, lr=lr, warmup_epochs=warmup)
    engines.check_bn_span(cfg.bn_span, engine.world_size)
    data_dir = cfg.data_dir or (str(ensure_embedded()) if cfg.loader != "synthetic" else "")
    loader = build_loader(dataclasses.replace(cfg, data_dir=data_dir), engine.rank, engine.world_size, engine.device)
    if engine.rank == 0:
        _check_out_dir(cfg)
    return cfg, loader, precision, data_dir, note


def _default_out_dir(cfg: Config) -> str:
    return cfg.out_dir or f"runs/{Path(cfg.preset).stem or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_out_dir(cfg: Config) -> None:
    out_dir = Path(cfg.out_dir) if cfg.out_dir else None
    if out_dir is None:
        return
    saved = out_dir / "checkpoint.pt"
    if cfg.resume and not saved.is_file():
        raise UsageError(f"{out_dir} holds no checkpoint.pt to resume from; check --out-dir or drop --resume")
    if saved.is_file():  # a run that is over stays as it is: a restarted finished job is not a failure
        done = _nothing_left(cfg, checkpoint.peek(saved))
        if done:
            raise RunFinished(f"{out_dir} holds a finished run ({done}); nothing to do, its files are unchanged")
    if not cfg.resume and any((out_dir / name).exists() for name in RUN_FILES):
        raise UsageError(f"{out_dir} already holds a run; pass --resume to continue it or choose another --out-dir")


def _nothing_left(cfg: Config, saved: dict) -> str:
    """Why a saved run has no step left to take under these settings, or "" when it has."""
    if saved.get("finished") == "target":
        return f"reached --target-accuracy at step {saved['step']}"
    if saved.get("finished") == "epochs" and saved["epoch"] >= cfg.epochs:
        return f"all {saved['epoch']} epochs done at step {saved['step']}"
    if cfg.resume and 0 < cfg.max_steps <= saved["step"]:
        return f"at step {saved['step']}, --max-steps {cfg.max_steps}"
    return ""


def _make_out_dir(cfg: Config, engine) -> Path:
    """Rank 0 creates the run directory and writes config.yaml; every rank learns the name. A
    failure leaves nothing behind: the folders made for it are removed again."""
    out_dir = Path(engine.broadcast_object(_default_out_dir(cfg)) if engine.world_size > 1 else _default_out_dir(cfg))
    if engine.rank == 0:
        first_new = next((p for p in reversed([out_dir, *out_dir.parents]) if not p.exists()), None)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(dataclasses.replace(cfg, out_dir=str(out_dir))),
                                                              sort_keys=False))
        except OSError as err:
            if first_new is not None:
                shutil.rmtree(first_new, ignore_errors=True)
            raise UsageError(f"cannot write the run directory {out_dir} ({err.strerror or err}); "
                             "choose a writable --out-dir") from err
    return out_dir


def _optimizer(cfg: Config, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    groups = lars_param_groups(model)
    if cfg.optimizer == "lars":
        return LARS(groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                    eta=cfg.lars_eta, epsilon=cfg.lars_epsilon)
    groups[0]["weight_decay"], groups[1]["weight_decay"] = cfg.weight_decay, 0.0
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, foreach=True)


def _eval_due(cfg: Config, epoch_number: int) -> bool:
    return cfg.eval_every > 0 and (epoch_number + cfg.eval_offset) % cfg.eval_every == 0


def _next_eval_epoch(cfg: Config, epoch_number: int) -> int:
    e = epoch_number
    while e < cfg.epochs and not _eval_due(cfg, e):
        e += 1
    return e


def _first_of_block(cfg: Config, epoch_number: int) -> bool:
    return epoch_number == 1 or _eval_due(cfg, epoch_number - 1) or not cfg.eval_every


def _check_finite(bad_steps: torch.Tensor, cfg: Config, step: int, out_dir: Path, engine) -> None:
    """Every rank stops once any rank's streak of non-finite losses reaches the limit."""
    if engine.any(int(bad_steps.item()) >= cfg.max_bad_steps):
        raise _agreed_error(Diverged(f"loss was not finite for {cfg.max_bad_steps} consecutive steps (at step {step}); "
                       f"stopped, last good checkpoint kept in {out_dir}; lower --lr"))


def _save(out_dir, model, optimizer, precision, cfg, step, epoch, step_in_epoch, engine, finished=None) -> None:
    """Rank 0 writes; every rank checks its weights (they are the same) and learns whether the
    write worked, so all stop together."""
    share_bn_statistics(model, engine, cfg.bn_span)
    norms = torch.stack(torch._foreach_norm([p.detach() for p in model.parameters()]))
    if not bool(norms.isfinite().all()):  # a NaN or inf anywhere makes its tensor's norm non-finite
        raise _agreed_error(Diverged(f"weights are not finite at step {step}; stopped, last good checkpoint kept in "
                                     f"{out_dir}; lower --lr"))
    problem = None
    if engine.rank == 0:
        try:
            checkpoint.save(out_dir / "checkpoint.pt", {
                "model": engines.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                "precision": precision.state_dict(), "step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
                "finished": finished, "config": to_dict(cfg)})
        except OSError as err:
            problem = (f"could not write {out_dir / 'checkpoint.pt'} at step {step} ({err.strerror or err}); "
                       "the previous checkpoint is kept; free disk space and --resume")
    if engine.any(problem is not None):
        raise _agreed_error(RunAborted(problem or "rank 0 could not write the checkpoint"))


def share_bn_statistics(model, engine, bn_span: int) -> None:
    """BatchNorm running statistics averaged over all ranks. Ranks whose BN groups are smaller than
    the world see different images and so keep different running statistics; averaging them before
    every evaluation and checkpoint makes the evaluated model and the saved model one and the same
    (the model every rank holds). Training never reads them, so steps are unchanged."""
    if engine.world_size == 1 or bn_span == engine.world_size:
        return
    buffers = [b for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
               for b in (m.running_mean, m.running_var) if b is not None]
    if not buffers:
        return
    mean = engine.all_reduce_sum(torch.cat([b.reshape(-1) for b in buffers])) / engine.world_size
    torch._foreach_copy_(buffers, [piece.view_as(b) for piece, b in zip(mean.split([b.numel() for b in buffers]), buffers)])


def replicas_differing(model, engine) -> int:
    """How many ranks hold a model (weights and buffers) that is not bit for bit rank 0's."""
    digest = hashlib.sha256()
    for tensor in engines.unwrap(model).state_dict().values():
        digest.update(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    differs = digest.hexdigest() != engine.broadcast_object(digest.hexdigest())
    return int(engine.all_reduce_sum(torch.tensor(int(differs), device=engine.device)).item())


@torch.no_grad()
def evaluate(model, loader, precision, engine) -> tuple[float, float, int]:
    """(top-1, top-5, images) over the whole validation set: global correct / global total."""
    model.eval()
    device = engine.device
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # top-1 hits, top-5 hits, images
    for images, labels in loader.val_batches():
        with precision.autocast():
            logits = model(images)
        top = logits.topk(min(5, logits.shape[1]), dim=1).indices
        hits = top == labels[:, None]
        counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), torch.tensor(len(labels), device=device)])
    counts = engine.all_reduce_sum(counts)
    top1, top5, total = counts.tolist()
    return top1 / max(total, 1), top5 / max(total, 1), total


def _evaluate_and_log(model, loader, precision, engine, log, cfg, epoch_number, step, global_batch, result):
    share_bn_statistics(model, engine, cfg.bn_span)
    log.start(K.EVAL_START, epoch_num=epoch_number)
    eval_start = time.time()
    top1, top5, total = evaluate(model, loader, precision, engine)
    eval_seconds = time.time() - eval_start
    skipped = _report_skipped(loader, engine, log, "validation")
    log.end(K.EVAL_STOP, epoch_num=epoch_number)
    log.event(K.EVAL_ACCURACY, top1, epoch_num=epoch_number)
    log.end(K.BLOCK_STOP, first_epoch_num=_block_first_epoch(cfg, epoch_number))
    log.metrics(kind="eval", step=step, epoch=epoch_number, images=step * global_batch,
                seconds=log.seconds(), top1=round(top1, 5), top5=round(top5, 5),
                eval_images=total, eval_seconds=round(eval_seconds, 3), skipped_images=skipped)
    log.print(f"eval  {epoch_number:3d}/{cfg.epochs}  top-1 {top1:.4f}  top-5 {top5:.4f}  ({total} images, {eval_seconds:.1f} s)")
    result.update(top1=top1, top5=top5, reached_target=bool(cfg.target_accuracy and top1 >= cfg.target_accuracy))


def _report_skipped(loader, engine, log, split: str) -> int:
    """Unreadable files skipped on all ranks since the last report, printed with a few names."""
    skipped, examples = loader.take_skipped()
    skipped = int(engine.all_reduce_sum(torch.tensor(skipped, device=engine.device)).item())
    if skipped:
        log.print(f"warning: skipped {skipped} unreadable {split} image(s), e.g. {', '.join(examples)}")
    return skipped


def _block_first_epoch(cfg: Config, epoch_number: int) -> int:
    e = epoch_number
    while e > 1 and not _first_of_block(cfg, e):
        e -= 1
    return e


def _log_setup(log, cfg, engine, precision, loader, global_batch, base_lr, schedule, init_start_ms) -> None:
    log.start(K.INIT_START, time_ms=init_start_ms)  # taken before any set-up work, written once the log exists
    device_name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else (platform.processor() or "CPU")
    for key, value in [
        (K.SUBMISSION_BENCHMARK, K.RESNET), (K.SUBMISSION_DIVISION, cfg.division),
        (K.SUBMISSION_ORG, cfg.submission_org), (K.SUBMISSION_STATUS, "research"),
        (K.SUBMISSION_PLATFORM, cfg.submission_platform or f"{engine.world_size}x{device_name}"),
        (K.CACHE_CLEAR, True), (K.SEED, cfg.seed),
        (K.GLOBAL_BATCH_SIZE, global_batch), (K.GRADIENT_ACCUMULATION_STEPS, 1),
        (K.TRAIN_SAMPLES, loader.train_images), (K.EVAL_SAMPLES, loader.val_images),
        (K.MODEL_BN_SPAN, cfg.batch_size * cfg.bn_span), (K.OPT_NAME, cfg.optimizer),
    ]:
        log.event(key, value)
    prefix = "lars_opt" if cfg.optimizer == "lars" else "sgd_opt"
    log.event(f"{prefix}_base_learning_rate", base_lr)
    log.event(f"{prefix}_end_learning_rate", cfg.end_lr)
    log.event(f"{prefix}_learning_rate_decay_poly_power", cfg.lr_decay_power)
    log.event(f"{prefix}_learning_rate_decay_steps", schedule.decay_steps)
    log.event(f"{prefix}_momentum", cfg.momentum)
    log.event(f"{prefix}_weight_decay", cfg.weight_decay)
    if cfg.optimizer == "lars":
        log.event(K.LARS_EPSILON, cfg.lars_epsilon)
        log.event(K.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS, cfg.warmup_epochs)
        log.event("lars_opt_trust_coefficient", cfg.lars_eta)
    else:
        log.event(K.OPT_LR_WARMUP_EPOCHS, cfg.warmup_epochs)
    log.event("label_smoothing", cfg.label_smoothing)
    log.event("precision", precision.name)
