"""How far apart the two loaders' evaluation batches are: `--loader torch` and `--loader dali` (CPU
operators here; a GPU machine runs DALI's device='mixed' with --device cuda) on the same validation
files, compared pixel by pixel in levels of 255 (the normalised difference times the std).

    python scripts/bench/eval_agreement.py [--data-dir DIR] [--image-size 32] [--device cpu]

Without --data-dir: the embedded dataset (300 validation JPEGs). Prints the largest and the mean
absolute difference, and how many images differ by more than one level anywhere.
Last line: `eval_agreement: MAX (goal <= 1)`.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.dali import DaliLoader  # noqa: E402
from data.embedded import ensure_embedded  # noqa: E402
from data.loaders import IMAGENET_STD, LoaderSettings  # noqa: E402
from data.torch_loader import TorchLoader  # noqa: E402
from data.tree import check_tree  # noqa: E402
from train.config import Config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    root = args.data_dir or str(ensure_embedded())
    device = torch.device(args.device)
    settings = LoaderSettings.of(Config(data_dir=root, image_size=args.image_size, batch_size=50, workers=2, precision="fp32"))
    classes = check_tree(root)
    dali, torch_loader = (cls(settings, classes, 0, 1, device) for cls in (DaliLoader, TorchLoader))
    std_255 = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255
    worst, mean, count = [], 0.0, 0
    for (a, labels_a), (b, labels_b) in zip(dali.val_batches(), torch_loader.val_batches(), strict=True):
        assert torch.equal(labels_a, labels_b), "the loaders read different files"
        levels = (a.float() - b.float()).abs() * std_255
        worst += levels.amax(dim=(1, 2, 3)).tolist()
        mean, count = mean + float(levels.mean()) * len(levels), count + len(levels)
    print(f"{count} images at {args.image_size} px on {device}: max {max(worst):.2f} levels, mean {mean / count:.3f}; "
          f"{sum(w > 1.001 for w in worst)} image(s) differ by more than one level")
    print(f"eval_agreement: {max(worst):.2f} (goal <= 1)")


if __name__ == "__main__":
    main()
