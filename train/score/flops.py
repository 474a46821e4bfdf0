"""FLOPs and Valid FLOPS (HPC AI500 v2.0): the FLOPs of a run are counted, not assumed, from what
its records say: the run's arch, class count and BlurPool, each epoch's crop size, the evaluation's
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


def run_flop(config: dict, images: int, eval_images: int, epoch_records: list[dict] = ()) -> float:
    """Total FLOPs of a run, for its arch, classes and BlurPool: images trained x forward + backward
    FLOPs per image at the crop size they were trained at (`epoch_records`: the run's epoch records,
    see images_by_size), plus images evaluated x forward FLOPs per image at the evaluation's size, twice
    for a flipped evaluation (--eval-flip: each image and its mirror image pass the model)."""
    from models import eval_flops_per_image, train_flops_per_image  # (loads torch)
    arch, classes, blurpool = config.get("arch", "resnet50"), num_classes(config), bool(config.get("blurpool"))
    eval_size = int(config.get("eval_image_size") or config.get("image_size", 224))
    passes = 2 if config.get("eval_flip") else 1
    trained = sum(count * train_flops_per_image(arch, size, classes, blurpool)
                  for size, count in images_by_size(config, images, epoch_records).items())
    return trained + passes * eval_images * eval_flops_per_image(arch, eval_size, classes, blurpool)


def images_by_size(config: dict, images: int, epoch_records: list[dict]) -> dict[int, int]:
    """Training crop size -> images trained at it, of the `images` a run trained. The epoch records of
    metrics.jsonl, in file order (each written at an epoch's end, or where a segment stopped, with the
    images trained by then and the crop size its images since the record before were trained at), say
    the size of each span; a run resumed with another --resolution-schedule is so counted as it ran. A
    record without a size (a run from before records had it) and the images after the last record (a
    crashed run's last steps) count at the size config.yaml's settings give their epoch."""
    from train.schedule import resolution_ramp
    ramp = resolution_ramp(str(config.get("resolution_schedule") or ""))

    def planned(epoch: int) -> int:  # the crop size of epoch `epoch` (from 0) by the run's settings
        return ramp(epoch) if ramp else int(config.get("image_size", 224))

    spans: list[tuple[int, int]] = []  # (images trained by the span's end, its crop size), the end rising
    for record in epoch_records:
        while spans and spans[-1][0] >= record["images"]:  # resumed from an earlier checkpoint: trained again
            spans.pop()
        in_epoch = max(math.ceil(record.get("epoch") or 0) - 1, 0)  # the epoch (from 0) the span lies in
        spans.append((record["images"], record.get("image_size") or planned(in_epoch)))
    after = math.floor(epoch_records[-1].get("epoch") or 0) if epoch_records else 0
    spans.append((images, planned(after)))  # after the last record: the epoch it stopped in, or the next
    counts, before = {}, 0
    for end, size in spans:
        counts[size] = counts.get(size, 0) + end - before
        before = end
    return {size: count for size, count in counts.items() if count}


def published_flop(images: int, arch: str, image_size: int) -> float:
    """Training FLOPs of a published result (ImageNet's 1,000 classes; its evaluations are not counted)."""
    from models import train_flops_per_image  # (loads torch)
    return images * train_flops_per_image(arch, image_size)
