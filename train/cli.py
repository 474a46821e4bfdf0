"""The command line: `python -m train`'s flags built from Config's fields and the registries that
serve each choice (engines, loaders, archs, optimizers, schedules, precisions), and the settings read
from them: defaults < preset (YAML) < the saved settings of a restarted or --resume'd run (config.yaml,
read once through train/rundir.py) < command-line flags. The same command started again on a run
directory holding its run continues it (restart is resume); start-up checks that it defines the same
run. `read_command` returns the decision on the run directory too (rundir.Start). No torch is loaded.

A preset is a name of a YAML file shipped in train/presets/ or a path to one.
"""
import argparse
import dataclasses
import importlib.util
import math
import os
from importlib import resources
from pathlib import Path

import yaml

from train.command import CommandParser
from train.config import CHOICES, FIELDS, GROUPS, RENAMED, Config
from train.errors import UsageError
from train.rundir import RunDir, Start, decide, keep_batch
from train.crops import NO_RAMP


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("train.presets").iterdir() if p.name.endswith(".yaml"))


def load_yaml_overrides(source: str, what: str) -> dict:
    """A YAML mapping of Config fields, type-checked; `source` is a file path."""
    try:
        values = yaml.safe_load(Path(source).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise _unreadable(source, what, err)
    return checked_overrides(values, source, what)


def _unreadable(source, what: str, err: Exception) -> UsageError:
    return UsageError(f"{what} {source} cannot be read as YAML ({str(err).splitlines()[0]}); fix or remove it")


def saved_overrides(run_dir: RunDir) -> dict:
    """The saved settings of the run in `run_dir` (its config.yaml, read once), type-checked."""
    try:
        values = run_dir.saved_settings()
    except (OSError, yaml.YAMLError) as err:
        raise _unreadable(run_dir.config, "saved config", err)
    return checked_overrides(dict(values) if isinstance(values, dict) else values, str(run_dir.config), "saved config")


def checked_overrides(values, source: str, what: str) -> dict:
    """`values` read from `source` as Config fields, type-checked (YAML's None: none)."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UsageError(f"{what} {source} must be a mapping of settings, not {type(values).__name__}")
    values = {RENAMED.get(str(key).replace("-", "_"), key): value for key, value in values.items()}
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


COMPILE_MODES = CHOICES["compile_mode"]  # torch.compile's modes ("default": torch's own)


def choices() -> dict[str, tuple]:
    """The names each choice setting takes (its field's choices: those of the registries that serve them)."""
    return CHOICES


USAGE = "python -m train [--preset NAME] [--data-dir PATH] [--out-dir PATH] [OPTIONS]"
EPILOG = ("The same command started again on a run directory continues its run. Examples: docs/README.md; "
          "the settings a preset resolves to: --show-recipe.")


def metavar(f) -> str:
    """N for counts, X for other numbers, NAME for a choice, PATH for a file or folder, else TEXT."""
    if f.type is int:
        return "N"
    if f.type is float:
        return "X"
    return f.metadata.get("metavar") or ("NAME" if f.name in choices() or f.name == "preset" else "TEXT")


def parser() -> argparse.ArgumentParser:
    """The flags, one argument group per task (config.GROUPS), each with its help and its default said once."""
    p = CommandParser(prog="python -m train", usage=USAGE, description="Train a ResNet on ImageNet-layout data.",
                      epilog=EPILOG, argument_default=argparse.SUPPRESS)
    names_taken = {**choices(), "preset": tuple(preset_names())}
    for title, members in GROUPS.items():
        group = p.add_argument_group(title)
        for name in members:
            f = FIELDS[name]
            help_text = f.metadata["help"]
            if "default:" not in help_text:  # a help that says its default in its own words keeps only that
                help_text += f" (default: {_shown(f.default)})"
            if f.name in names_taken:  # the names go before the default
                body, default_said, default = help_text.partition(" (default:")
                help_text = f"{body}; one of {', '.join(names_taken[f.name])}{default_said}{default}"
            _add_flag(group, f, "--" + f.name.replace("_", "-"), help_text)
    groups = {group.title: group for group in p._action_groups}
    for old, new in RENAMED.items():  # the old spelling still works, unlisted, in its setting's group
        _add_flag(groups[FIELDS[new].metadata["group"]], FIELDS[new], "--" + old.replace("_", "-"), argparse.SUPPRESS)
    return p


def _add_flag(group, f, flag: str, help_text: str) -> None:
    if f.type is bool:
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
    else:
        group.add_argument(flag, dest=f.name, type=f.type, metavar=metavar(f), help=help_text)


def _shown(default) -> str:
    """A default as a user types it: on/off, a number without float noise, a name unquoted, '' as none."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default) if default != "" else "none"


# Settings derived from one another: a flag on the command line wins over its partner's value from
# the preset or the saved run (a per-rank --batch-size over a preset's global batch, and so on).
# Two flags of a pair given together must agree (checked once the rank count is known).
# (the global batch is ranks x batch x accumulation steps: a global batch or a batch given alone leaves the other
# two to start-up, accumulation steps given alone split the global batch)
PARTNERS = {"batch_size": ("global_batch_size", "accumulation_steps"), "global_batch_size": ("batch_size", "accumulation_steps"),
            "accumulation_steps": ("batch_size",), "lr": ("lr_per_256",), "lr_per_256": ("lr",)}
BATCH_FLAGS = ("batch_size", "global_batch_size", "accumulation_steps")


def parse(argv: list[str]) -> Config:
    """The settings of a command line (read_command's)."""
    return read_command(argv)[0]


def read_command(argv: list[str]) -> tuple[Config, Start]:
    """Defaults, then the preset, then a restarted or --resume'd run's saved settings, then the flags;
    and what the start does with its run directory."""
    flags = vars(parser().parse_args(argv))
    given = tuple(flags)  # (before start-up's own entries: --out-dir, --resume)
    values: dict = {}
    preset = flags.get("preset") or ("" if flags.get("data_dir") else "smoke")
    preset_values = load_yaml_overrides(str(resolve_preset(preset)), "preset") if preset else {}
    if preset:
        values.update(preset_values, preset=preset)
    out_dir = flags.get("out_dir") or job_out_dir(preset)
    if out_dir:
        flags["out_dir"] = out_dir
    # restart is resume: the same command started again (a requeued job, a relaunched worker, a preempted
    # run) continues its run from its checkpoint, or starts it again when it was lost before its first;
    # start-up checks that the command defines the same run (RunDir.check_same_run)
    start = decide(out_dir, bool(flags.get("resume")), bool(flags.get("test_only")))
    if flags.get("test_only"):
        flags["resume"] = False
    from_saved = start.kind in ("resume", "evaluate")
    if from_saved:
        what = "--test-only" if flags.get("test_only") else "--resume"
        if not out_dir:
            raise UsageError(f"{what} needs --out-dir naming the run")
        if not start.run_dir.holds_config():
            raise UsageError(f"{out_dir} holds no {RunDir.CONFIG} for {what}; check --out-dir")
        values.update(saved_overrides(start.run_dir))
    elif "lr" in preset_values and not {"lr", "lr_per_256"} & set(given):  # (the header notes another global batch)
        values["preset_lr_batch"] = preset_values.get("global_batch_size", 0)
    if flags.get("batch_size", 1) <= 0:
        raise UsageError(f"--batch-size must be positive, got {flags['batch_size']}")
    for name, partners in PARTNERS.items():
        for partner in partners if name in flags else ():
            if partner not in flags:
                values[partner] = FIELDS[partner].default
    start = keep_saved_batch(values, flags, start)
    leave_out_sizes(values, flags, start, "the run's saved config" if from_saved else f"preset {preset}")
    values.update(flags, flags_given=given)
    if values.get("resolution_schedule", "").strip().lower() in NO_RAMP:
        values["resolution_schedule"] = ""  # (config.yaml records no ramp one way, whichever word said it)
    if values.get("tensorboard", True) and importlib.util.find_spec("tensorboard") is None:
        if flags.get("tensorboard"):
            raise UsageError("--tensorboard needs the tensorboard package; pip install tensorboard, or drop the flag")
        values["tensorboard"] = False  # on by default only where it is installed
    cfg = validate(Config(**values))
    return cfg, start


def keep_saved_batch(values: dict, flags: dict, start: Start) -> Start:
    """The global batch defines the run: started again (a restart: an elastic launcher's, a requeue on a
    smaller allocation; or --resume without batch flags), it keeps it, and keeps its per-rank batch where
    the new rank count divides, by accumulating more or fewer steps (batches.split_batch). A restart's
    own --batch-size and --accumulation-steps are not taken; a restart whose command names the run's own
    global batch is the same command started again. Returns the start with what it kept."""
    if start.restarted:
        saved_overrides(start.run_dir)  # (a config.yaml that is not a mapping of settings: refused here)
    kept = keep_batch(start, flags.get("global_batch_size"), bool(set(BATCH_FLAGS) & set(flags)))
    if not kept.saved_batch:
        return start
    command = (flags.pop("batch_size", 0), flags.pop("accumulation_steps", 0)) if start.restarted else ()
    values.update(batch_size=0, global_batch_size=start.run_dir.saved_settings()["global_batch_size"],
                  accumulation_steps=0)
    return dataclasses.replace(kept, command_batch=command)


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
    for name, number_field in FIELDS.items():
        if not number_field.metadata["bounds"]:
            continue
        (test, wording), value, flag = number_field.metadata["bounds"], getattr(cfg, name), "--" + name.replace("_", "-")
        if FIELDS[name].type is float:
            _need(math.isfinite(value), f"{flag} must be a finite number, got {value}")
        if name == "target_accuracy" and 1 < value <= 100:  # 75.9 would never be reached: top-1 is a fraction
            raise UsageError(f"--target-accuracy {value:g} is a percentage; give the fraction {value / 100:g}")
        _need(test(value), f"{flag} must be {wording}, got {value}")
    _need(cfg.crop_min_scale <= cfg.crop_max_scale, "--crop-min-scale must not be above --crop-max-scale")
    _need(cfg.crop_min_aspect <= cfg.crop_max_aspect, "--crop-min-aspect must not be above --crop-max-aspect")


def _check_names_and_schedules(cfg: Config) -> None:
    """Names and the schedule texts read alone, before any rule that combines settings."""
    for name, allowed in choices().items():
        value = getattr(cfg, name)
        _need(value in allowed, f"unknown --{name.replace('_', '-')} {value!r}; choose {', '.join(allowed[:-1])} or {allowed[-1]}")
    from train.crops import resolution_ramp
    from train.schedule import batch_changes, decay_epochs, lr_phases
    try:
        changes = batch_changes(cfg.batch_schedule)
        resolution_ramp(cfg.resolution_schedule)
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
    _need(not cfg.raw_weights or cfg.test_only, "--raw-weights is --test-only's (it evaluates the trained weights, "
          "not the --ema-decay average); add --test-only, or drop it")
    _need(not cfg.test_checkpoint or cfg.test_only, f"--test-checkpoint {cfg.test_checkpoint} names what --test-only evaluates; "
          "to start a run from its weights, give --init-from")
    if not cfg.save_checkpoints:  # (what would be written, asked for by name)
        writing_flags = [flag for flag, value in (("--keep-checkpoints", cfg.keep_checkpoints), ("--checkpoint-every-steps",
                 cfg.checkpoint_every_steps), ("--checkpoint-every-minutes", cfg.checkpoint_every_minutes)) if value]
        _need(not writing_flags, f"{writing_flags[0] if writing_flags else ''} writes checkpoints, which --no-save-checkpoints turns off; drop one of them")
    _need(cfg.division == "open" or (not cfg.batch_schedule and cfg.optimizer in ("lars", "sgd")
                                     and cfg.lr_schedule == "warmup-poly"),
          "--batch-schedule, --optimizer rmsprop-warmup and --lr-schedule other than warmup-poly are not allowed in the "
          "MLPerf closed division; use --division open")


def leave_out_sizes(values: dict, flags: dict, start: Start, source: str) -> None:
    """An --image-size given alone trains and evaluates at that size: the preset's (or a --resume'd
    run's saved) ramp would override it from the first epoch, and its evaluation size was chosen for
    its own training size (256 px beside 160-192), so each is left out unless given too, and the header
    says so (crops.crop_note). A restarted run that recorded the ramp keeps it: the same command
    continues the same run, whichever rule made it."""
    if "image_size" not in flags:
        return
    left_out = []
    ramp = values.get("resolution_schedule", "")
    recorded = start.restarted and ramp == saved_overrides(start.run_dir).get("resolution_schedule")
    if "resolution_schedule" not in flags and ramp.strip().lower() not in NO_RAMP and not recorded:
        values["resolution_schedule"] = ""
        left_out.append(f"--resolution-schedule {ramp}")
    if "eval_image_size" not in flags and values.get("eval_image_size"):
        left_out.append(f"--eval-image-size {values.pop('eval_image_size')}")
    if left_out:
        values["left_out"] = f"{' and '.join(left_out)} of {source}"


def job_out_dir(preset: str) -> str:
    """A default run directory named after the launcher's job, which a restart of the job finds again:
    Slurm's job id (kept by a requeue), or torchrun's rendezvous id (--rdzv-id, or --standalone's, kept
    across --max-restarts). "" without one (Horovod and mpirun give no id that survives a relaunch)."""
    slurm, torchrun = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("TORCHELASTIC_RUN_ID", "none")
    name = f"slurm-{slurm}" if slurm else f"torchrun-{torchrun}" if torchrun not in ("", "none") else ""
    return f"runs/{Path(preset).stem or 'run'}-{name}" if name else ""
