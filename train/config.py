"""The run's settings: defaults < preset (YAML) < saved config of a --resume'd run < command-line flags.
The same command started again on a run directory holding its checkpoint continues the run (restart
is resume); start-up checks that it defines the same run.

Every field is a flag with the usual spelling (batch_size -> --batch-size). A preset is a name
of a YAML file shipped in train/presets/ or a path to one.
"""
import argparse
import dataclasses
import importlib.util
import math
import os
import textwrap
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import yaml


class UsageError(ValueError):
    """Bad input: the message names the problem and what to do; the CLI exits with code 2."""


@dataclass
class Config:
    # data
    data_dir: str = field(default="", metadata={"help": "ImageNet-layout tree (train/<class>/, val/<class>/); empty: the embedded dataset"})
    loader: str = field(default="torch", metadata={"help": "input pipeline"})
    workers: int = field(default=4, metadata={"help": "input threads per rank: the torch loader's decoding threads, DALI's CPU threads"})
    threads: int = field(default=0, metadata={"help": "compute threads per rank (torch's intra-op threads; 0: OMP_NUM_THREADS if set, else the cores this process may use shared by the ranks on its host, less the loader's --workers on a GPU run, at least 1; docs/threads.md)"})
    image_size: int = field(default=224, metadata={"help": "training and evaluation crop size in pixels"})
    crop_min_scale: float = field(default=0.08, metadata={"help": "smallest area fraction of random-resized-crop"})
    crop_max_scale: float = field(default=1.0, metadata={"help": "largest area fraction of random-resized-crop"})
    crop_min_aspect: float = field(default=3 / 4, metadata={"help": "smallest aspect ratio of random-resized-crop"})
    crop_max_aspect: float = field(default=4 / 3, metadata={"help": "largest aspect ratio of random-resized-crop"})
    synthetic_images: int = field(default=1_281_167, metadata={"help": "training-set size of --loader synthetic"})
    synthetic_val_images: int = field(default=50_000, metadata={"help": "validation-set size of --loader synthetic"})
    synthetic_classes: int = field(default=1000, metadata={"help": "classes of --loader synthetic"})
    num_classes: int = field(default=0, metadata={"help": "classes the data must have (0: as many as it has); a run records its count in config.yaml"})
    # model
    arch: str = field(default="resnet50", metadata={"help": "a torchvision ResNet"})
    zero_init_residual: bool = field(default=True, metadata={"help": "zero the last BN gamma of every residual block"})
    channels_last: bool = field(default=True, metadata={"help": "NHWC memory format for model and batches"})
    bn_group_size: int = field(default=0, metadata={"help": "ghost BatchNorm: statistics over groups of this many images inside a rank's batch (0: the whole per-rank batch); with --bn-span S, group i of S ranks together"})
    bn_recompute_batches: int = field(default=0, metadata={"help": "BatchNorm without moving averages: before each evaluation, statistics recomputed over the last K training batches, averaged over all ranks (0: running averages)"})
    init_from_seed: bool = field(default=False, metadata={"help": "every rank builds the initial model from --seed instead of receiving rank 0's by broadcast (a checksum checks they agree)"})
    precision: str = field(default="auto", metadata={"help": "fp16 is CUDA only; auto: bf16 on Ampere+, fp16 on older GPUs, fp32 on CPU"})
    # optimisation
    optimizer: str = field(default="lars", metadata={"help": "optimizer (train/optim.py)"})
    lr_schedule: str = field(default="warmup-poly", metadata={"help": "what changes during the run (train/schedule.py)"})
    batch_size: int = field(default=0, metadata={"help": "images per rank per step (0: --global-batch-size / ranks, or 256 when neither is set)"})
    global_batch_size: int = field(default=0, metadata={"help": "images per step over all ranks (0: --batch-size x ranks)"})
    batch_schedule: str = field(default="", metadata={"help": "batch-size control: 'E:B,...' = global batch B after E epochs (e.g. '30:69632'); per-rank batch and LR follow"})
    epochs: int = field(default=90, metadata={"help": "length of the run and of the LR schedule"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate for the global batch (0: chosen from the global batch, see docs/learning_rate.md)"})
    lr_per_256: float = field(default=0.0, metadata={"help": "if set, peak LR = this x global batch / 256"})
    warmup_epochs: float = field(default=-1.0, metadata={"help": "linear warmup length in epochs (-1: chosen from the global batch)"})
    end_lr: float = field(default=1e-4, metadata={"help": "LR at the last step of the polynomial decay"})
    lr_decay_power: float = field(default=2.0, metadata={"help": "power of the polynomial decay"})
    warmup_start_lr: float = field(default=0.0, metadata={"help": "LR the warmup ramps up from, per step (0: from 0)"})
    lr_decay_epochs: str = field(default="30,60,80", metadata={"help": "--lr-schedule multistep: epochs after which the LR is multiplied by --lr-decay-factor"})
    lr_decay_factor: float = field(default=0.1, metadata={"help": "--lr-schedule multistep: LR factor at each --lr-decay-epochs"})
    lr_phases: str = field(default="", metadata={"help": "--lr-schedule phases: 'EPOCHS:FACTOR,...' = the peak LR x FACTOR for that many epochs (slow start)"})
    nesterov: bool = field(default=False, metadata={"help": "Nesterov momentum (--optimizer sgd)"})
    sgd_share_center: float = field(default=10.0, metadata={"help": "--optimizer rmsprop-warmup: epoch at which the momentum-SGD share of the update passes 1/2"})
    sgd_share_width: float = field(default=5.0, metadata={"help": "--optimizer rmsprop-warmup: epochs over which the SGD share rises from 0 to 1"})
    rmsprop_lr_ratio: float = field(default=0.001, metadata={"help": "--optimizer rmsprop-warmup: the RMSprop term's LR as a fraction of the LR"})
    rmsprop_alpha: float = field(default=0.99, metadata={"help": "--optimizer rmsprop-warmup: decay of the squared-gradient average"})
    rmsprop_epsilon: float = field(default=1e-8, metadata={"help": "--optimizer rmsprop-warmup: added to the RMS"})
    momentum: float = field(default=0.9)
    weight_decay: float = field(default=5e-5)
    lars_eta: float = field(default=0.001, metadata={"help": "LARS trust coefficient"})
    lars_epsilon: float = field(default=0.0, metadata={"help": "LARS epsilon (0 means 0)"})
    lars_compile: bool = field(default=False, metadata={
        "help": "run the LARS update through torch.compile (fewer passes over memory; the first step compiles)"})
    label_smoothing: float = field(default=0.1)
    augment_off_epoch: int = field(default=0, metadata={"help": "from this epoch on (counted from 1) training images get the evaluation transform, no random crop or flip (0: never)"})
    # evaluation
    eval_every: int = field(default=4, metadata={"help": "evaluate every N epochs (0: never)"})
    eval_offset: int = field(default=0, metadata={"help": "evaluate after epoch e when (e + offset) %% eval_every == 0"})
    target_accuracy: float = field(default=0.0, metadata={"help": "stop once top-1, a fraction (0.759 for 75.9 percent), reaches this (0: run all epochs)"})
    # run
    engine: str = field(default="auto", metadata={"help": "auto: from the launcher's environment"})
    allreduce: str = field(default="flat", metadata={"help": "hierarchical: reduce-scatter in the node, all-reduce across nodes, all-gather; torus: the same on a grid of --torus-rows, half of each bucket each way (docs/allreduce.md)"})
    ranks_per_node: int = field(default=0, metadata={"help": "node size for --allreduce hierarchical (0: ranks sharing a host name)"})
    torus_rows: int = field(default=0, metadata={"help": "--allreduce torus: ranks in one line of the grid, among which the reduce-scatter runs (0: the ranks per node)"})
    fp16_allreduce: bool = field(default=False, metadata={"help": "send gradients as fp16 (Horovod fp16 compression / DDP fp16 hook)"})
    bn_span: int = field(default=1, metadata={"help": "BatchNorm statistics over groups of this many consecutive ranks"})
    stop_check_every: int = field(default=10, metadata={"help": "steps between the ranks' agreement on a preemption signal"})
    out_dir: str = field(default="", metadata={"help": "run directory (default: runs/<preset>-<time>)"})
    seed: int = field(default=0)
    max_steps: int = field(default=0, metadata={"help": "stop after N optimizer steps (0: no limit)"})
    log_every: int = field(default=50, metadata={"help": "steps between throughput log points"})
    tensorboard: bool = field(default=True, metadata={"help": "also write the train, epoch and eval records as TensorBoard scalars into RUN/tensorboard (rank 0) (default: on where the tensorboard package is installed)"})
    checkpoint_every: int = field(default=1, metadata={"help": "epochs between checkpoints (the end is always saved)"})
    checkpoint_every_steps: int = field(default=0, metadata={"help": "also checkpoint every N optimizer steps, written in the background (0: never)"})
    checkpoint_every_minutes: float = field(default=0.0, metadata={"help": "also checkpoint every M minutes of training (rank 0's clock, agreed by all ranks), written in the background (0: never)"})
    keep_checkpoints: int = field(default=0, metadata={"help": "besides checkpoint.pt (the latest), keep checkpoint-epochNNN.pt of the last N epochs and checkpoint-best.pt of the best top-1 evaluated (hard links to the finished checkpoint.pt; 0: only checkpoint.pt)"})
    commit_every: int = field(default=50, metadata={"help": "Horovod Elastic: commit the state to host memory every N steps (and at epoch ends); a lost worker costs the steps since"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out-dir from its checkpoint.pt (the same command does so by itself; --resume insists on a checkpoint and may change settings)"})
    init_from: str = field(default="", metadata={"help": "start a new run from these weights: another run's checkpoint, a torchvision ResNet state_dict file, or another script's checkpoint (weights under model, state_dict, ...; DDP's module. dropped); another class count keeps the new fc (fine-tuning)"})
    command_batch_size: int = field(default=0, metadata={"internal": True})  # set by parse: a restart's --batch-size, not taken
    restarted: bool = field(default=False, metadata={"internal": True})  # set by parse: the command found its own run (its config.yaml) in --out-dir
    show_recipe: bool = field(default=False, metadata={"help": "print the resolved settings and the per-epoch schedule (global batch, LR, augmentation) as JSON, and stop"})
    test_only: bool = field(default=False, metadata={"help": "evaluate --out-dir's checkpoint on the validation set of its data (or --data-dir) and print top-1/top-5; changes nothing in the run"})
    checkpoint: str = field(default="", metadata={"help": "--test-only evaluates this checkpoint: a file in --out-dir (checkpoint-best.pt, checkpoint-epoch010.pt: --keep-checkpoints) or a path (default: --out-dir's checkpoint.pt)"})
    max_bad_steps: int = field(default=20, metadata={"help": "stop after this many consecutive non-finite losses"})
    division: str = field(default="open", metadata={"help": "MLPerf division declared in the log"})
    submission_org: str = field(default="reference-trainer")
    submission_platform: str = field(default="", metadata={"help": "default: <ranks>x<device name>"})
    preset: str = field(default="", metadata={"help": "YAML preset name in train/presets or a path (default: smoke without --data-dir)"})


FIELDS = {f.name: f for f in fields(Config) if not f.metadata.get("internal")}
PREEMPTED_MARKER = "PREEMPTED"  # written beside checkpoint.pt when a signal stopped the run


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("train.presets").iterdir() if p.name.endswith(".yaml"))


def load_yaml_overrides(source: str, what: str) -> dict:
    """A YAML mapping of Config fields, type-checked; `source` is a file path."""
    try:
        values = yaml.safe_load(Path(source).read_text())
    except (OSError, yaml.YAMLError) as err:
        reason = str(err).splitlines()[0]
        raise UsageError(f"{what} {source} cannot be read as YAML ({reason}); fix or remove it")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UsageError(f"{what} {source} must be a mapping of settings, not {type(values).__name__}")
    for key, value in values.items():
        key_field = FIELDS.get(str(key).replace("-", "_"))
        if key_field is None or (key_field.name == "preset" and what == "preset"):
            raise UsageError(f"{what} {source} has unknown setting {key!r}; see python -m train --help")
        if key_field.type is float and isinstance(value, str):
            value = values[key] = _number(value)  # YAML 1.1 reads 5e-5 (no dot) as a string
        if not _fits(value, key_field.type):
            raise UsageError(f"{what} {source}: {key} must be {key_field.type.__name__}, got {value!r}")
    return {str(k).replace("-", "_"): (float(v) if FIELDS[str(k).replace("-", "_")].type is float else v)
            for k, v in values.items()}


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _fits(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def resolve_preset(name: str) -> Path:
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        if not Path(name).is_file():
            raise UsageError(f"preset file {name} does not exist")
        return Path(name)
    if name not in preset_names():
        raise UsageError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())} or give a .yaml path")
    return Path(str(resources.files("train.presets") / f"{name}.yaml"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 like every other bad input, not argparse's usage block
        raise UsageError(f"{message}; see python -m train --help")


def choices() -> dict[str, tuple]:
    """The names each choice setting takes, from the registries that serve them."""
    from data import LOADERS
    from models import ARCHS
    from train.engines import ALLREDUCE, ENGINES
    from train.optim import OPTIMIZERS
    from train.precision import PRECISIONS
    from train.schedule import SCHEDULES
    return {"loader": tuple(LOADERS), "arch": tuple(ARCHS), "precision": PRECISIONS, "optimizer": tuple(OPTIMIZERS),
            "lr_schedule": tuple(SCHEDULES), "engine": ("auto", *ENGINES), "allreduce": ALLREDUCE,
            "division": ("open", "closed")}


class _HelpFormatter(argparse.HelpFormatter):
    def _split_lines(self, text, width):  # names like mlperf-bs1632 stay whole on one line
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m train", description="Train a ResNet on ImageNet-layout data.",
                argument_default=argparse.SUPPRESS, formatter_class=_HelpFormatter)
    named = {**choices(), "preset": tuple(preset_names())}
    for f in FIELDS.values():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if "default:" not in help_text:  # a help that says its default in its own words keeps only that
            help_text += f" (default: {f.default!r})"
        if f.name in named:  # the names go before the default
            body, said, default = help_text.partition(" (default:")
            help_text = f"{body}; one of {', '.join(named[f.name])}{said}{default}"
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            p.add_argument(flag, type=f.type, metavar=f.name.upper(), help=help_text)
    return p


# Settings derived from one another: a flag on the command line wins over its partner's value from
# the preset or the saved run (a per-rank --batch-size over a preset's global batch, and so on).
# Two flags of a pair given together must agree (checked once the rank count is known).
PARTNERS = {"batch_size": "global_batch_size", "global_batch_size": "batch_size", "lr": "lr_per_256", "lr_per_256": "lr"}


def parse(argv: list[str]) -> Config:
    """Defaults, then the preset, then (with --resume) the run's saved config, then the flags."""
    flags = vars(parser().parse_args(argv))
    values: dict = {}
    preset = flags.get("preset") or ("" if flags.get("data_dir") else "smoke")
    if preset:
        values.update(load_yaml_overrides(str(resolve_preset(preset)), "preset"))
        values["preset"] = preset
    out_dir = flags.get("out_dir") or job_out_dir(preset)
    if out_dir:
        flags["out_dir"] = out_dir
    if flags.get("test_only"):
        flags["resume"] = False
    elif not flags.get("resume") and out_dir and (Path(out_dir) / "config.yaml").is_file():
        # restart is resume: the same command started again (a requeued job, a relaunched worker, a preempted
        # run) continues its run from its checkpoint, or starts it again when it was lost before its first;
        # start-up checks that the command defines the same run (startup.check_same_run)
        values["restarted"] = True
        flags["resume"] = (Path(out_dir) / "checkpoint.pt").is_file()
    if (flags.get("resume") and not values.get("restarted")) or flags.get("test_only"):
        what = "--test-only" if flags.get("test_only") else "--resume"
        if not out_dir:
            raise UsageError(f"{what} needs --out-dir naming the run")
        saved = Path(out_dir) / "config.yaml"
        if not saved.is_file():
            raise UsageError(f"{out_dir} holds no config.yaml for {what}; check --out-dir")
        values.update(load_yaml_overrides(str(saved), "saved config"))
    if flags.get("batch_size", 1) <= 0:
        raise UsageError(f"--batch-size must be positive, got {flags['batch_size']}")
    for name, partner in PARTNERS.items():
        if name in flags and partner not in flags:
            values[partner] = FIELDS[partner].default
    if values.get("restarted") and "global_batch_size" not in flags:
        # the global batch defines the run: a restart on another rank count (an elastic launcher's) keeps it,
        # whatever per-rank batch the command names; the per-rank batch follows from the rank count
        saved = load_yaml_overrides(str(Path(out_dir) / "config.yaml"), "saved config").get("global_batch_size")
        if saved:
            values.update(batch_size=0, global_batch_size=saved, command_batch_size=flags.pop("batch_size", 0))
    values.update(flags)
    if values.get("tensorboard", True) and importlib.util.find_spec("tensorboard") is None:
        if flags.get("tensorboard"):
            raise UsageError("--tensorboard needs the tensorboard package; pip install tensorboard, or drop the flag")
        values["tensorboard"] = False  # on by default only where it is installed
    return validate(Config(**values))


# The values each number setting may take: (test, what the refusal says it must be). A float must be
# finite as well; every int and float field has an entry (tests/test_validation.py checks).
ZERO_OR_MORE = (lambda v: v >= 0, "0 or more")
AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
ABOVE_0 = (lambda v: v > 0, "more than 0")
BELOW_1 = (lambda v: 0 <= v < 1, "in [0, 1)")
BOUNDS = {
    "workers": ZERO_OR_MORE, "threads": ZERO_OR_MORE, "image_size": (lambda v: v >= 16, "at least 16"),
    "crop_min_scale": (lambda v: 0 < v <= 1, "in (0, 1]"), "crop_max_scale": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "crop_min_aspect": ABOVE_0, "crop_max_aspect": ABOVE_0,
    "synthetic_images": AT_LEAST_1, "synthetic_val_images": AT_LEAST_1, "synthetic_classes": AT_LEAST_1,
    "num_classes": ZERO_OR_MORE, "bn_group_size": ZERO_OR_MORE, "bn_recompute_batches": ZERO_OR_MORE,
    "batch_size": (lambda v: v >= 0, "positive"), "global_batch_size": (lambda v: v >= 0, "positive"),
    "epochs": (lambda v: v >= 1, "positive"), "lr": ZERO_OR_MORE, "lr_per_256": ZERO_OR_MORE,
    "warmup_epochs": (lambda v: v >= 0 or v == -1, "0 or more (-1: chosen from the global batch)"),
    "end_lr": ZERO_OR_MORE, "lr_decay_power": ZERO_OR_MORE, "warmup_start_lr": ZERO_OR_MORE,
    "lr_decay_factor": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "sgd_share_center": ZERO_OR_MORE, "sgd_share_width": ZERO_OR_MORE, "rmsprop_lr_ratio": ZERO_OR_MORE,
    "rmsprop_alpha": BELOW_1, "rmsprop_epsilon": ABOVE_0,
    "momentum": BELOW_1, "weight_decay": ZERO_OR_MORE, "lars_eta": ABOVE_0, "lars_epsilon": ZERO_OR_MORE,
    "label_smoothing": BELOW_1, "augment_off_epoch": ZERO_OR_MORE, "eval_every": ZERO_OR_MORE,
    "eval_offset": ZERO_OR_MORE, "target_accuracy": (lambda v: 0 <= v <= 1, "a fraction in (0, 1] (0: run all epochs)"),
    "ranks_per_node": ZERO_OR_MORE, "torus_rows": ZERO_OR_MORE, "bn_span": AT_LEAST_1, "stop_check_every": AT_LEAST_1,
    "seed": (lambda v: 0 <= v < 2 ** 32, "in [0, 2**32)"), "max_steps": ZERO_OR_MORE, "log_every": AT_LEAST_1,
    "checkpoint_every": AT_LEAST_1, "checkpoint_every_steps": ZERO_OR_MORE, "checkpoint_every_minutes": ZERO_OR_MORE,
    "keep_checkpoints": ZERO_OR_MORE,
    "commit_every": AT_LEAST_1, "max_bad_steps": AT_LEAST_1,
}


def validate(cfg: Config) -> Config:
    """Each setting alone (numbers in range, names known, schedules readable), then the combinations."""
    _check_numbers(cfg)
    _check_names_and_schedules(cfg)
    _check_combinations(cfg)
    return cfg


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def _check_numbers(cfg: Config) -> None:
    for name, (test, wording) in BOUNDS.items():
        value, flag = getattr(cfg, name), "--" + name.replace("_", "-")
        if FIELDS[name].type is float:
            _need(math.isfinite(value), f"{flag} must be a finite number, got {value}")
        if name == "target_accuracy" and 1 < value <= 100:  # 75.9 would never be reached: top-1 is a fraction
            raise UsageError(f"--target-accuracy {value:g} is a percentage; give the fraction {value / 100:g}")
        _need(test(value), f"{flag} must be {wording}, got {value}")
    _need(cfg.crop_min_scale <= cfg.crop_max_scale, "--crop-min-scale must not be above --crop-max-scale")
    _need(cfg.crop_min_aspect <= cfg.crop_max_aspect, "--crop-min-aspect must not be above --crop-max-aspect")


def _check_names_and_schedules(cfg: Config) -> None:
    """Names and the schedule texts read alone, before any rule that combines settings."""
    for name, names in choices().items():
        value = getattr(cfg, name)
        _need(value in names, f"unknown --{name.replace('_', '-')} {value!r}; choose {', '.join(names[:-1])} or {names[-1]}")
    from train.schedule import batch_changes, decay_epochs, lr_phases
    try:
        changes = batch_changes(cfg.batch_schedule)
        if cfg.lr_schedule == "multistep":
            decay_epochs(cfg.lr_decay_epochs)
        phases = lr_phases(cfg.lr_phases) if cfg.lr_schedule == "phases" else []
    except ValueError as err:
        raise UsageError(str(err)) from None
    _need(all(math.isfinite(number) for phase in phases for number in phase),
          f"--lr-phases {cfg.lr_phases!r}: give finite numbers, e.g. '40:0.5,30:0.075'")
    late = [epoch for epoch, _ in changes if epoch >= cfg.epochs]
    if late:  # a change after the last epoch would never happen
        raise UsageError(f"--batch-schedule {cfg.batch_schedule!r}: a change after epoch {late[0]} never happens in "
                         f"a {cfg.epochs}-epoch run; give epochs below --epochs {cfg.epochs}")


def _check_combinations(cfg: Config) -> None:
    _need(not (cfg.nesterov and cfg.momentum <= 0), "--nesterov needs a positive --momentum")
    _need(not cfg.lars_compile or cfg.optimizer == "lars", "--lars-compile needs --optimizer lars")
    _need(not cfg.checkpoint or cfg.test_only, f"--checkpoint {cfg.checkpoint} names what --test-only evaluates; "
          "to start a run from its weights, give --init-from")
    _need(cfg.division == "open" or (not cfg.batch_schedule and cfg.optimizer in ("lars", "sgd")
                                     and cfg.lr_schedule == "warmup-poly"),
          "--batch-schedule, --optimizer rmsprop-warmup and --lr-schedule other than warmup-poly are not allowed in the "
          "MLPerf closed division; use --division open")


def to_dict(cfg: Config) -> dict:
    return {name: value for name, value in dataclasses.asdict(cfg).items() if name in FIELDS}


def job_out_dir(preset: str) -> str:
    """A default run directory named after the launcher's job, which a restart of the job finds again:
    Slurm's job id (kept by a requeue), or torchrun's rendezvous id (--rdzv-id, or --standalone's, kept
    across --max-restarts). "" without one (Horovod and mpirun give no id that survives a relaunch)."""
    slurm, torchrun = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("TORCHELASTIC_RUN_ID", "none")
    name = f"slurm-{slurm}" if slurm else f"torchrun-{torchrun}" if torchrun not in ("", "none") else ""
    return f"runs/{Path(preset).stem or 'run'}-{name}" if name else ""
