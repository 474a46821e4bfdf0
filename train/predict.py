"""`python -m train.predict CHECKPOINT_OR_RUN PATH...`: a trained model's top-k classes for image files.

Every image goes through the evaluation transform of training (train/inference.py: the data package's
decode, resize, centre crop and normalisation) at the run's evaluation size, in batches on the GPU
when there is one, under the run's precision (train/precision.py's autocast), and is classified as
the run's evaluation classifies it: the weights it evaluated (its --ema-decay average where it kept
one) and, where it evaluated with --eval-flip, the mean of the image's and its mirror's logits. So on
the run's validation folder the top-1 and top-5 are --test-only's. `--onnx FILE` classifies with ONNX
Runtime and a file written by `python -m train.export` instead of a checkpoint (its class names,
preprocessing and flips from its metadata). docs/inference.md.
"""
import argparse
import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from train.command import CommandParser
from train.errors import UsageError
from train.rundir import RunDir

if TYPE_CHECKING:
    import torch

# torch, and train.inference and train.precision that load it, are imported by the code that runs a
# model: --help and a refused flag answer without loading torch

USAGE = ("python -m train.predict CHECKPOINT_OR_RUN PATH... [OPTIONS]\n"
         "       python -m train.predict --onnx FILE PATH... [OPTIONS]")


def parser() -> argparse.ArgumentParser:
    """The flags, one argument group per task, each with its help and its default said once."""
    p = CommandParser(prog="python -m train.predict", usage=USAGE, description=__doc__.splitlines()[0],
                      epilog="Examples and details: docs/inference.md.")
    p.add_argument("inputs", nargs="+", metavar="CHECKPOINT_OR_RUN PATH",
                   help=f"a checkpoint file or a run directory (its {RunDir.CHECKPOINT}), then image files and folders "
                        "(searched recursively); with --onnx, image files and folders only")
    model = p.add_argument_group("the model")
    model.add_argument("--onnx", metavar="FILE", help="classify with ONNX Runtime and this file of python -m "
                       "train.export instead of a checkpoint")
    model.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                       help="average each image's logits with its left-right mirror's, as --eval-flip does "
                            "(default: as the run's evaluation did; with --onnx, as the file's metadata says)")
    model.add_argument("--raw-weights", action="store_true",
                       help="the weights as trained, not the --ema-decay average the run evaluated and kept (a run "
                            "that kept no average evaluated its trained weights: they are taken either way)")
    shown = p.add_argument_group("what is shown and written")
    shown.add_argument("--top-k", type=int, default=5, metavar="N", help="classes shown per image (default: 5)")
    shown.add_argument("--labels-from-folders", action="store_true",
                       help="each image's label is its folder's name (an ImageNet-layout split): end with top-1 and "
                            "top-5 over them, as --test-only prints")
    shown.add_argument("--json", metavar="FILE", help="also write the predictions as a JSON list, one object per image")
    shown.add_argument("--csv", metavar="FILE", help="also write the predictions as CSV, one row per image")
    speed = p.add_argument_group("batches and threads")
    speed.add_argument("--batch-size", type=int, default=64, metavar="N", help="images per forward pass (default: 64)")
    speed.add_argument("--workers", type=int, default=0, metavar="N", help="decoding threads (default: 0, the cores, "
                       "up to 8)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_intermixed_args(argv)  # (options anywhere: `RUN --no-flip photos` as well as at the end)
    if args.top_k < 1 or args.batch_size < 1:
        raise UsageError("--top-k and --batch-size must be at least 1")
    if args.onnx and args.raw_weights:
        raise UsageError("--raw-weights chooses among a checkpoint's weights; an ONNX file holds the ones it was "
                         "exported with: export it with python -m train.export --raw-weights")
    if args.onnx:
        args.source, args.paths = None, args.inputs
    elif len(args.inputs) < 2:
        raise UsageError("give a checkpoint (or run directory) and then at least one image file or folder")
    else:
        args.source, args.paths = args.inputs[0], args.inputs[1:]
    return args


class CheckpointModel:
    """The checkpoint's model on the GPU when there is one, under the run's precision; `flip`: mirrored
    images averaged in (None: as the run's evaluation did)."""

    def __init__(self, source: str, flip: bool | None, raw: bool):
        from train.engines.launch import local_device
        from train.inference import load_trained
        from train.precision import Precision
        self.device = local_device(0)  # (its GPU checked to be one the installed torch has kernels for)
        trained = load_trained(source, self.device, raw)
        self.model, self.class_names, self.image_size = trained.model, trained.class_names, trained.image_size
        self.flip = trained.flip if flip is None else flip
        self.channels_last = bool(trained.config.get("channels_last", False))
        try:
            self.precision = Precision(trained.precision, self.device)
        except UsageError:  # an fp16 run (CUDA only) on a machine without a GPU
            print(f"warning: {trained.checkpoint} trained in {trained.precision}, which needs a CUDA GPU; "
                  "classifying in fp32", file=sys.stderr)
            self.precision = Precision("fp32", self.device)

    def logits(self, batch: "torch.Tensor") -> "torch.Tensor":
        import torch

        from train.inference import evaluated_logits
        with torch.no_grad(), self.precision.autocast():  # (the flips averaged under autocast, as evaluate does)
            return evaluated_logits(self.model, batch, self.flip).float()


class OnnxModel:
    """An exported ONNX file run by ONNX Runtime on the CPU; its class names, input size and flips (unless
    `flip` says) from its metadata."""

    def __init__(self, path: str, flip: bool | None):
        import torch

        from train.inference import flip_of, image_size_of
        try:
            import onnxruntime
        except ImportError:
            raise UsageError("--onnx needs onnxruntime: pip install -e '.[onnx]'") from None
        if not Path(path).is_file():
            raise UsageError(f"--onnx {path} is not a file; give a model written by python -m train.export --format onnx")
        try:
            self.session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime's own kinds: InvalidProtobuf, Fail, ...
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
            raise UsageError(f"--onnx {path} cannot be loaded by ONNX Runtime ({first}); "
                             "give a model written by python -m train.export --format onnx") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            self.class_names = [str(name) for name in json.loads(meta["class_names"])]
        except (KeyError, ValueError, TypeError):
            raise UsageError(f"--onnx {path} has no class_names metadata; export it with python -m train.export") from None
        self.image_size = image_size_of(meta.get("preprocessing", ""), f"--onnx {path}")
        self.flip = flip_of(meta.get("evaluation"), f"--onnx {path}") if flip is None else flip
        self.input = self.session.get_inputs()[0].name
        self.device, self.channels_last = torch.device("cpu"), False

    def logits(self, batch: "torch.Tensor") -> "torch.Tensor":
        from train.inference import evaluated_logits
        return evaluated_logits(self._run, batch, self.flip)

    def _run(self, batch: "torch.Tensor") -> "torch.Tensor":
        import torch
        return torch.from_numpy(self.session.run(None, {self.input: batch.contiguous().numpy()})[0]).float()


def main(argv: list[str] | None = None) -> int:
    try:
        return predict(parse(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def predict(args: argparse.Namespace) -> int:
    from train.inference import Images, find_images
    paths = find_images(args.paths)
    if not paths:
        raise UsageError(f"no images found in {', '.join(map(str, args.paths))} (files ending in .jpg, .jpeg, .png, "
                         ".ppm, .bmp, .pgm, .tif, .tiff or .webp); give image files or folders that hold some")
    model = OnnxModel(args.onnx, args.flip) if args.onnx else CheckpointModel(args.source, args.flip, args.raw_weights)
    names, k = model.class_names, min(args.top_k, len(model.class_names))
    images = Images(model.image_size, model.device, model.channels_last, args.workers)
    table = Table(paths, names, k, args.labels_from_folders)
    results, skipped = [], []

    def on_skipped(path, why):
        skipped.append(path)
        print(f"warning: skipped {path}: {why}", file=sys.stderr, flush=True)

    hits = [0, 0]  # top-1, top-5 against the folder names
    try:
        table.header()
        for batch_paths, batch in images.batches(paths, args.batch_size, on_skipped):
            logits = model.logits(batch).cpu()
            probabilities = logits.softmax(dim=1)
            top = logits.topk(max(k, min(5, len(names))), dim=1).indices  # as --test-only ranks them: by logit
            for path, row, ranked in zip(batch_paths, probabilities, top.tolist()):
                result = {"path": str(path), "top_k": [{"class": names[i], "index": i, "probability": round(float(row[i]), 6)}
                                                       for i in ranked[:k]]}
                if args.labels_from_folders:
                    label = result["label"] = path.parent.name
                    hits[0] += names[ranked[0]] == label
                    hits[1] += label in (names[i] for i in ranked[:min(5, len(names))])
                results.append(result)
                table.row(result)
    finally:
        images.close()
    if not results:
        raise UsageError(f"none of the {len(paths)} image files could be read (each named above)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.csv:
        write_csv(Path(args.csv), results, k, args.labels_from_folders)
    if args.labels_from_folders:
        unknown = sorted({r["label"] for r in results} - set(names))
        if unknown:
            print(f"warning: {len(unknown)} folder name(s) are no class of the model (e.g. {unknown[0]!r}); "
                  "their images count as misses", file=sys.stderr)
        print(f"top-1 {hits[0] / len(results):.4f}  top-5 {hits[1] / len(results):.4f}  ({len(results)} images)", flush=True)
    return 0


class Table:
    """The predictions on stdout, a row per image as it is classified: the file, its label with
    --labels-from-folders, then each of the top-k classes with its probability. Each column is as wide
    as its longest entry (all paths are known before the first row), so every row lines up with the
    header and each path is shown whole, as --json and --csv write it."""

    def __init__(self, paths, names, k, labels):
        self.k, self.labels = k, labels
        self.path_width = max(len("image"), *(len(str(p)) for p in paths))
        folders = [p.parent.name for p in paths] if labels else []  # (a folder that is no class may be longer)
        self.name_width = max(len("top-1"), *(len(n) for n in [*names, *folders]))

    def header(self) -> None:
        cells = ["image".ljust(self.path_width)] + (["label".ljust(self.name_width)] if self.labels else [])
        cells += [f"{f'top-{i + 1}'.ljust(self.name_width)} {'prob':>6}" for i in range(self.k)]
        print("  ".join(cells).rstrip(), flush=True)

    def row(self, result: dict) -> None:
        cells = [result["path"].ljust(self.path_width)] + ([result["label"].ljust(self.name_width)] if self.labels else [])
        cells += [f"{c['class'].ljust(self.name_width)} {c['probability']:.4f}" for c in result["top_k"]]
        print("  ".join(cells).rstrip(), flush=True)


def write_csv(path: Path, results: list[dict], k: int, labels: bool) -> None:
    """One row per image: path, (label,) then class_1, probability_1, ... class_k, probability_k."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", *(["label"] if labels else []),
                         *(f"{what}_{i + 1}" for i in range(k) for what in ("class", "probability"))])
        for r in results:
            writer.writerow([r["path"], *([r["label"]] if labels else []),
                             *(value for c in r["top_k"] for value in (c["class"], c["probability"]))])


if __name__ == "__main__":
    sys.exit(main())
