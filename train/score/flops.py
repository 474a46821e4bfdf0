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


def run_flop(config: dict, images: int, eval_images: int) -> float:
    """Total FLOPs of a run: images trained x forward + backward FLOPs per image, plus images
    evaluated x forward FLOPs per image, for the run's arch, image size and classes."""
    from models import eval_flops_per_image, train_flops_per_image  # (loads torch)
    arch, size = config.get("arch", "resnet50"), int(config.get("image_size", 224))
    classes = num_classes(config)
    return images * train_flops_per_image(arch, size, classes) + eval_images * eval_flops_per_image(arch, size, classes)


def published_flop(images: int, arch: str, image_size: int) -> float:
    """Training FLOPs of a published result (ImageNet's 1,000 classes; its evaluations are not counted)."""
    from models import train_flops_per_image  # (loads torch)
    return images * train_flops_per_image(arch, image_size)
