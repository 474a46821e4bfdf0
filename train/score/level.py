"""The HPC AI500 level of a run (hardware, system or free), from what its config.yaml changed
against the reference recipe."""
from dataclasses import asdict

# The hyperparameters of the reference recipe: changing any of them moves a run to the system level.
RECIPE_KEYS = ("optimizer", "global_batch_size", "epochs", "lr", "warmup_epochs", "end_lr", "lr_decay_power",
               "weight_decay", "momentum", "lars_eta", "lars_epsilon", "label_smoothing",
               # the recipe mechanisms: any of them set differently is the system's own recipe
               "lr_schedule", "batch_schedule", "warmup_start_lr", "lr_decay_epochs", "lr_decay_factor", "lr_phases",
               "nesterov", "bn_group_size", "bn_recompute_batches", "augment_off_epoch", "sgd_share_center",
               "sgd_share_width", "rmsprop_lr_ratio", "rmsprop_alpha", "rmsprop_epsilon", "ema_decay")


def hpc_ai500_level(config: dict) -> tuple[str, str]:
    """Free, system or hardware level, from what the run changed against the reference recipe
    (ResNet-50 at 224 px, MLPerf LARS with a reference convergence point's hyperparameters)."""
    if config.get("arch") != "resnet50" or config.get("image_size") != 224:
        return "free", f"the model changed ({config.get('arch')} at {config.get('image_size')} px; reference resnet50 at 224)"
    # the epoch-cutting methods that change the model or what is evaluated (docs/time_to_accuracy.md)
    changed = [name for name, value in (("blurpool", config.get("blurpool") is True),
                                        ("resolution_schedule", bool(config.get("resolution_schedule"))),
                                        ("eval_image_size", config.get("eval_image_size") not in (None, 0, 224)),
                                        ("eval_flip", config.get("eval_flip") is True)) if value]
    if changed:
        return "free", f"the model or its evaluation changed ({', '.join(changed)})"
    preset = str(config.get("preset", ""))
    if preset.startswith("mlperf-bs"):
        from train.cli import load_yaml_overrides, resolve_preset
        from train.config import Config
        # What the preset leaves out the run got from the trainer's defaults, so those are the reference too.
        reference = {**asdict(Config()), **load_yaml_overrides(str(resolve_preset(preset)), "preset")}
        # A key absent from the run's config.yaml (an older run) is unknown, not changed.
        changed = [k for k in RECIPE_KEYS if config.get(k) is not None and config[k] != reference[k]]
        if not changed:
            return "hardware", f"the reference recipe {preset} unchanged; only the hardware differs"
        return "system", f"{preset} with {', '.join(changed)} changed (system software and hyperparameters)"
    return "system", "no reference recipe preset: batch size and learning-rate policy are the system's own"
