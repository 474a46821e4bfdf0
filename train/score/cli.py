"""The command line of `python -m train.score` (see the package's docstring)."""
import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import train.score as package  # its docstring's first paragraph is the CLI's description
from train.command import CommandParser
from train.errors import UsageError
from train.score.flops import HPC_AI500_POWER, HPC_AI500_TARGET, IMAGENET_TRAIN_IMAGES
from train.score.mlperf import MLPERF_TARGET, mlperf_score
from train.score.report import draw_report, mlperf_line, table
from train.score.runs import Score, ScoreError, score_published, score_run


USAGE = ("python -m train.score RUN_DIR [RUN_DIR ...] [OPTIONS]\n"
         "       python -m train.score --time-s T --top1 A [OPTIONS]")


def parser() -> argparse.ArgumentParser:
    """The flags, one argument group per task, each with its help and its default said once."""
    p = CommandParser(prog="python -m train.score", usage=USAGE, description=package.__doc__.split("\n\n")[0],
                      epilog="How Valid FLOPS is computed: docs/valid_flops.md; the MLPerf rules: docs/mlperf.md.")
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (a run's --out-dir) to score")
    measure = p.add_argument_group("Valid FLOPS and the MLPerf verdict")
    measure.add_argument("--target", type=float, default=HPC_AI500_TARGET, metavar="X",
                         help=f"Valid FLOPS's target top-1 (default: {HPC_AI500_TARGET}, HPC AI500's)")
    measure.add_argument("--power", type=float, default=HPC_AI500_POWER, metavar="X",
                         help=f"Valid FLOPS's exponent n (default: {HPC_AI500_POWER}, HPC AI500's)")
    measure.add_argument("--mlperf-target", type=float, default=MLPERF_TARGET, metavar="X",
                         help=f"the top-1 whose first reaching ends a run's time to target, drawn in the report "
                              f"(default: {MLPERF_TARGET}, MLPerf's)")
    measure.add_argument("--no-check", action="store_true", help="skip the MLPerf compliance checker (no verdict)")
    published = p.add_argument_group("a published result (instead of run directories)")
    published.add_argument("--time-s", type=float, metavar="X", help="its time to train, seconds (with --top1)")
    published.add_argument("--top1", type=float, metavar="X", help="its top-1 accuracy, a fraction (with --time-s)")
    published.add_argument("--epochs", type=float, default=90, metavar="X", help="epochs it trained (default: 90)")
    published.add_argument("--train-images", type=int, default=IMAGENET_TRAIN_IMAGES, metavar="N",
                           help=f"images in an epoch (default: {IMAGENET_TRAIN_IMAGES}, ImageNet's)")
    published.add_argument("--arch", default="resnet50", metavar="NAME", help="its model, whose FLOPs are counted "
                           "(default: resnet50)")
    published.add_argument("--image-size", type=int, default=224, metavar="N", help="its input size in pixels "
                           "(default: 224)")
    output = p.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the table (for several "
                        "runs: the list and the MLPerf aggregate)")
    output.add_argument("--report", metavar="PATH", help="also draw the throughput and accuracy plots: a PNG file, or "
                        "a folder for its report.png")
    return p


def scores_of(args: argparse.Namespace) -> list[Score]:
    """The published result, or each run directory that can be scored (a warning on stderr for each
    that cannot); ScoreError when nothing can be scored."""
    if args.time_s is not None or args.top1 is not None:
        if args.time_s is None or args.top1 is None:
            raise ScoreError("a published result needs both --time-s and --top1")
        return [score_published(args.time_s, args.top1, args.epochs, train_images=args.train_images, arch=args.arch,
                                image_size=args.image_size, target=args.target, power=args.power)]
    if not args.runs:
        raise ScoreError("give run directories, or --time-s and --top1 for a published result")
    scores, problems = [], []
    for run in args.runs:
        try:
            scores.append(score_run(Path(run), args.target, args.power, args.mlperf_target, not args.no_check))
        except ScoreError as err:
            problems.append(str(err))
    if not scores:  # each problem once, in the one error line
        raise ScoreError("; ".join(problems))
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return scores


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        scores = scores_of(args)
    except (ScoreError, UsageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    aggregate = mlperf_score(scores) if len(scores) > 1 else None
    if args.report:
        print(f"report: {draw_report([s for s in scores if s.status != 'published'], Path(args.report), args.mlperf_target)}",
              file=sys.stderr)
    if args.json:
        if len(scores) == 1:
            print(json.dumps(asdict(scores[0])))
        else:
            print(json.dumps({"runs": [asdict(s) for s in scores], "mlperf": aggregate}))
    else:
        print(table(scores))
        if aggregate:
            print(mlperf_line(aggregate))
    return 0
