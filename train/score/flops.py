"""FLOPs and Valid FLOPS (HPC AI500 v2.0): the FLOPs of a run are counted, not assumed, from what
its records say: the run's arch, class count and BlurPool, each epoch's crop size, each evaluation's
size and flips (models.train_flops_per_image, eval_flops_per_image; docs/valid_flops.md).
models is imported by the functions that count: it loads torch, and --help of train.score and
train.plan prints without it."""

import math

HPC_AI500_TARGET, HPC_AI500_POWER = 0.763, 5
IMAGENET_TRAIN_IMAGES = 1_281_167


def valid_flops(flops: float, top1: float, target: float = HPC_AI500_TARGET, power: float = HPC_AI500_POWER) -> float:
    return flops * (top1 / target) ** power


def num_classes(config: dict) -> int:
    """Classes of the run's model (only the last layer's FLOPs depend on it: 0.05% of ResNet-50's):
    the count the run recorded in config.yaml, or for a run made before it did, a guess from its data."""
    recorded = config.get("num_classes")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return recorded
    if config.get("loader") == "synthetic":
        return int(config.get("synthetic_classes", 1000))
    return 1000 if config.get("data_dir") else 10  # ImageNet, or the embedded dataset's ten classes


def run_flop(config: dict, images: int, evaluations: list[dict] | int, records: list[dict] = ()) -> float:
    """Total FLOPs of a run, for its arch, classes and BlurPool: images trained x forward + backward
    FLOPs per image at the crop size they were trained at (`records`: the run's epoch and resume
    records, see images_by_size), plus each evaluation's images x forward FLOPs per image at its crop
    size, twice for a flipped evaluation (--eval-flip: each image and its mirror image pass the model).
    `evaluations`: the run's eval records (see eval_settings), or a count of images evaluated at the
    settings of config.yaml."""
    from models import eval_flops_per_image, train_flops_per_image  # (loads torch)
    arch, classes, blurpool = config.get("arch", "resnet50"), num_classes(config), bool(config.get("blurpool"))
    if isinstance(evaluations, int):
        evaluations = [{"eval_images": evaluations}]
    trained = sum(count * train_flops_per_image(arch, size, classes, blurpool)
                  for size, count in images_by_size(config, images, records).items())
    evaluated = 0
    for record in evaluations:
        size, passes = eval_settings(config, record)
        evaluated += record.get("eval_images", 0) * passes * eval_flops_per_image(arch, size, classes, blurpool)
    return trained + evaluated


def eval_settings(config: dict, record: dict) -> tuple[int, int]:
    """(crop size, forward passes per image) of one evaluation: the eval_image_size and eval_flip its
    eval record holds (a resume may change them), else, for a record without them (a run from before
    the records held them, one scored from mllog.txt alone), those of config.yaml."""
    size = record.get("eval_image_size") or config.get("eval_image_size") or config.get("image_size", 224)
    flip = record["eval_flip"] if "eval_flip" in record else config.get("eval_flip")
    return int(size), 2 if flip else 1


def images_by_size(config: dict, images: int, records: list[dict]) -> dict[int, int]:
    """Training crop size -> images trained at it, of the `images` a run trained. The epoch records of
    metrics.jsonl, in file order (each written at an epoch's end, or where a segment stopped, with the
    images trained by then and the crop size its images since the record before were trained at), say
    the size of each span; a run resumed with another --resolution-schedule is so counted as it ran. A
    resume record (its checkpoint's step) drops the spans recorded past it: they were trained again. A
    record without a size (a run from before records had it) and the images after the last record (a
    crashed run's last steps) count at the size config.yaml's settings give their epoch."""
    from train.crops import resolution_ramp
    ramp = resolution_ramp(str(config.get("resolution_schedule") or ""))

    def planned(epoch: int) -> int:  # the crop size of epoch `epoch` (from 0) by the run's settings
        return ramp(epoch) if ramp else int(config.get("image_size", 224))

    # (images trained by the span's end, its crop size, its step: 0 where a hand-made record has none), rising
    spans: list[tuple[int, int, int]] = []
    for record in records:
        if record.get("kind") == "resume":  # from a checkpoint at its step: the spans past it were trained again
            while spans and spans[-1][2] > record["step"]:
                spans.pop()
            continue
        while spans and spans[-1][0] >= record["images"]:  # resumed from an earlier checkpoint: trained again
            spans.pop()
        in_epoch = max(math.ceil(record.get("epoch") or 0) - 1, 0)  # the epoch (from 0) the span lies in
        spans.append((record["images"], record.get("image_size") or planned(in_epoch), record.get("step", 0)))
    after = math.floor(records[-1].get("epoch") or 0) if records else 0
    spans.append((images, planned(after), 0))  # after the last record: the epoch it stopped in, or the next
    counts, before = {}, 0
    for end, size, _ in spans:
        counts[size] = counts.get(size, 0) + end - before
        before = end
    return {size: count for size, count in counts.items() if count}


def published_flop(images: int, arch: str, image_size: int) -> float:
    """Training FLOPs of a published result (ImageNet's 1,000 classes; its evaluations are not counted)."""
    from models import train_flops_per_image  # (loads torch)
    return images * train_flops_per_image(arch, image_size)
