"""The command line of `python -m train.score` (see the package's docstring)."""
import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import train.score as package  # its docstring's first line is the CLI's description
from train.score.flops import HPC_AI500_POWER, HPC_AI500_TARGET, IMAGENET_TRAIN_IMAGES
from train.score.mlperf import MLPERF_TARGET, mlperf_score
from train.score.report import draw_report, mlperf_line, table
from train.score.runs import Score, ScoreError, score_published, score_run


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.score", description=package.__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run directories")
    parser.add_argument("--json", action="store_true", help="one JSON object (a list plus the aggregate for several runs)")
    parser.add_argument("--target", type=float, default=HPC_AI500_TARGET, help="Valid FLOPS target top-1 (HPC AI500: 0.763)")
    parser.add_argument("--power", type=float, default=HPC_AI500_POWER, help="Valid FLOPS exponent n (HPC AI500: 5)")
    parser.add_argument("--mlperf-target", type=float, default=MLPERF_TARGET)
    parser.add_argument("--no-check", action="store_true", help="skip the MLPerf compliance checker")
    parser.add_argument("--report", help="PNG file (or folder) for throughput and accuracy plots")
    published = parser.add_argument_group("a published result")
    published.add_argument("--time-s", type=float)
    published.add_argument("--top1", type=float)
    published.add_argument("--epochs", type=float, default=90)
    published.add_argument("--train-images", type=int, default=IMAGENET_TRAIN_IMAGES)
    published.add_argument("--arch", default="resnet50")
    published.add_argument("--image-size", type=int, default=224)
    return parser


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
    args = parser().parse_args(argv)
    try:
        scores = scores_of(args)
    except ScoreError as err:
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
