"""The command line of `python -m train.bench` (train/bench.py): its modes, train and infer, and each
one's flags in argument groups by task. Light: --help prints without loading torch."""
import argparse

from train.command import CommandParser
from train.config import CHOICES
from train.crops import MAX_CROP, MIN_CROP

BACKENDS = ("eager", "compile", "onnxruntime")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _crop_size(text: str) -> int:
    value = _positive(text)
    if not MIN_CROP <= value <= MAX_CROP:
        raise argparse.ArgumentTypeError(f"{value} is not a size from {MIN_CROP} to {MAX_CROP} px")
    return value


def _train_flags(p: argparse.ArgumentParser) -> None:
    steps = p.add_argument_group("the measured steps")
    steps.add_argument("--warmup-steps", type=_positive, default=5, metavar="N",
                       help="steps run before the measured ones (default: 5)")
    steps.add_argument("--steps", type=_positive, default=20, metavar="N", help="measured steps (default: 20)")
    output = p.add_argument_group("output")
    output.add_argument("--report", default="bench-train.json", metavar="FILE",
                        help="the JSON report rank 0 writes (default: bench-train.json)")
    output.add_argument("--profile", default="", metavar="DIR", help="also write a torch.profiler trace of the first "
                        "measured steps, DIR/trace-rank{R}.json.gz per rank R (gzipped Chrome trace JSON: Perfetto, "
                        "TensorBoard's trace viewer; docs/bench.md); the profiled steps' timings include the "
                        "profiler's cost (default: no trace)")


def _infer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", nargs="?", default="", metavar="CHECKPOINT_OR_RUN", help="a checkpoint file or a run "
                   "directory (default: an untrained --arch)")
    model = p.add_argument_group("the model (without CHECKPOINT_OR_RUN)")
    model.add_argument("--arch", default="resnet50", choices=CHOICES["arch"], metavar="NAME",
                       help=f"the untrained model: one of {', '.join(CHOICES['arch'])} (default: resnet50)")
    model.add_argument("--num-classes", type=_positive, default=1000, metavar="N",
                       help="the untrained model's classes (default: 1000)")
    runs = p.add_argument_group("what is timed")
    runs.add_argument("--image-size", type=_crop_size, default=0, metavar="N",
                      help=f"the input size, {MIN_CROP} to {MAX_CROP} pixels (default: the run's evaluation "
                           "size; 224 for an untrained model)")
    runs.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                      help="two passes per batch, as an evaluation with --eval-flip: the images and their mirror "
                           "images, the logits averaged; --no-flip: one pass (default: as the run's evaluation; one "
                           "pass for an untrained model)")
    runs.add_argument("--precision", default="", choices=("", *CHOICES["precision"]), metavar="NAME",
                      help=f"one of {', '.join(CHOICES['precision'])} (default: the run's; auto for an untrained model: "
                           "by the device, as a run chooses)")
    runs.add_argument("--batch-sizes", default="1,8,32,128,256", metavar="N,N,...",
                      help="batch sizes, comma-separated (default: 1,8,32,128,256)")
    runs.add_argument("--backends", default=",".join(BACKENDS), metavar="NAME,...", help=f"backends, comma-separated, "
                      f"of {', '.join(BACKENDS)} (default: all; onnxruntime left out with a note where it is not "
                      "installed, unless named)")
    runs.add_argument("--warmup-iterations", type=_positive, default=5, metavar="N",
                      help="untimed calls per batch size first (default: 5)")
    runs.add_argument("--iterations", type=_positive, default=30, metavar="N",
                      help="timed calls per batch size (default: 30)")
    runs.add_argument("--threads", type=int, default=0, metavar="N",
                      help="torch's intra-op threads (default: 0, torch's own choice)")
    output = p.add_argument_group("output")
    output.add_argument("--report", default="bench-infer.json", metavar="FILE", help="the JSON report; the PNG is "
                        "written beside it with the same name (default: bench-infer.json)")


USAGE = ("python -m train.bench train [--warmup-steps N] [--steps N] [--report FILE] [--profile DIR] "
         "[any flag of python -m train]\n"
         "       python -m train.bench infer [CHECKPOINT_OR_RUN] [OPTIONS]")
MODE_PARSERS = {  # each mode's parser: (its summary, its usage, the function that adds its flags)
    "train": ("time the trainer's own step: its wait for data against its compute, over the ranks; every other flag "
              "is python -m train's (python -m train --help)", USAGE.splitlines()[0], _train_flags),
    "infer": ("time inference of a trained model (or an untrained --arch) per batch size and backend",
              USAGE.splitlines()[1].strip(), _infer_flags),
}


def parser() -> argparse.ArgumentParser:
    """The command and its modes (subcommands, as mode_parser builds each), for --help."""
    p = CommandParser(prog="python -m train.bench", usage=USAGE, description="Time the trainer's own step (train) and "
                      "a trained model's answers (infer).", epilog="Each mode's flags: python -m train.bench MODE "
                      "--help; details: docs/bench.md.")
    modes = p.add_subparsers(title="modes", dest="mode", metavar="MODE", prog=p.prog)
    for name, (summary, _, add_flags) in MODE_PARSERS.items():
        add_flags(modes.add_parser(name, help=summary, **_mode_settings(name)))
    return p


def mode_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one mode, `python -m train.bench NAME`: its flags in argument groups by task."""
    p = CommandParser(prog=f"python -m train.bench {name}", **_mode_settings(name))
    MODE_PARSERS[name][2](p)
    return p


def _mode_settings(name: str) -> dict:
    summary, usage, _ = MODE_PARSERS[name]
    return {"usage": usage, "description": summary[0].upper() + summary[1:] + ".", "allow_abbrev": False}
