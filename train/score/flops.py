"""FLOPs and Valid FLOPS (HPC AI500 v2.0): the FLOPs of a run are counted, not assumed, from the
run's arch, image size and class count (models.train_flops_per_image, eval_flops_per_image).
models is imported by the functions that count: it loads torch, and --help of train.score and
train.plan prints without it."""

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


def run_flop(config: dict, images: int, eval_images: int, epoch_ends: dict | None = None) -> float:
    """Total FLOPs of a run: images trained x forward + backward FLOPs per image at the crop size they
    were trained at, plus images evaluated x forward FLOPs per image at the evaluation's size, for the
    run's arch and classes. `epoch_ends` (epochs done -> images trained by then) places the images of
    a run with progressive resizing in their epochs."""
    from models import eval_flops_per_image, train_flops_per_image  # (loads torch)
    arch, classes = config.get("arch", "resnet50"), num_classes(config)
    eval_size = int(config.get("eval_image_size") or config.get("image_size", 224))
    trained = sum(count * train_flops_per_image(arch, size, classes)
                  for size, count in images_by_size(config, images, epoch_ends or {}).items())
    return trained + eval_images * eval_flops_per_image(arch, eval_size, classes)


def images_by_size(config: dict, images: int, epoch_ends: dict) -> dict[int, int]:
    """Training crop size -> images trained at it: all at --image-size, or with --resolution-schedule
    each epoch's images (`epoch_ends`: epochs done -> images trained by then) at that epoch's size."""
    from train.schedule import resolution_ramp
    ramp = resolution_ramp(str(config.get("resolution_schedule") or ""))
    if ramp is None:
        return {int(config.get("image_size", 224)): images}
    counts, before, epoch = {}, 0, 0
    while before < images:
        end = min(max(epoch_ends.get(epoch + 1, images), before), images)
        counts[ramp(epoch)] = counts.get(ramp(epoch), 0) + end - before
        before, epoch = end, epoch + 1
    return counts


def published_flop(images: int, arch: str, image_size: int) -> float:
    """Training FLOPs of a published result (ImageNet's 1,000 classes; its evaluations are not counted)."""
    from models import train_flops_per_image  # (loads torch)
    return images * train_flops_per_image(arch, image_size)
