"""`python -m train.export CHECKPOINT_OR_RUN --format onnx|pt2 --out FILE`: a run's model for other
programs, then checked against itself.

The model is exported in fp32 whatever precision it trained in, with a dynamic batch dimension: the
weights the run evaluated (its --ema-decay average where it kept one; --raw-weights: the trained
ones). Its input is one float32 NCHW batch already through the evaluation transform of training
(resized, centre-cropped, normalised: train/inference.py `preprocessing`), its first output the
logits of those images alone; where the run evaluated with --eval-flip, its metadata `evaluation`
says that the run averaged them with the mirror images' (predict --onnx does it).

- onnx: `torch.onnx.export` (torch's dynamo exporter, which needs onnxscript), input "images",
  output "logits", with metadata_props `class_names` (a JSON list), `preprocessing` and
  `evaluation` (JSON), `weights` (ema_average or trained).
- pt2: `torch.export.export` + `torch.export.save` (load with `torch.export.load(FILE).module()`),
  the same facts in FILE.json beside it (and inside the archive as extra file metadata.json).

Then the file is checked: ONNX with onnx.checker and ONNX Runtime, pt2 by loading it back, each
against the PyTorch model on a batch of real validation images of the run's data (its config's
data_dir; the embedded dataset's, generated on first use, for a run without image files). The largest
absolute logit difference and whether top-1 agrees on every image are printed; above --tolerance
(1e-4) the file is removed and the exit status is 1. docs/inference.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from train.command import CommandParser
from train.errors import UsageError
from train.rundir import RunDir

if TYPE_CHECKING:
    import torch

    from train.inference import Trained

# torch, and train.inference that loads it, are imported by the functions that use them: --help and a
# refused flag answer without loading torch

TOLERANCE = 1e-4  # the largest absolute logit difference an export may show against the PyTorch model
CHECK_IMAGES = 16  # validation images in the check's batch, spread over the split
INSTALL = "pip install -e '.[onnx]' (scripts/setup.sh installs it)"


def _fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model as exported: a copy (the caller's model stays as it is) in fp32, eval mode, on the
    CPU, contiguous weights."""
    import torch
    return copy.deepcopy(model).float().eval().cpu().to(memory_format=torch.contiguous_format)


def _example(image_size: int) -> tuple[torch.Tensor]:
    import torch
    return (torch.zeros(2, 3, image_size, image_size),)


def _batch_dim():
    import torch
    return ({0: torch.export.Dim("batch")},)  # (2 in the example, any size at run time)


def export_onnx(model: torch.nn.Module, image_size: int, out: Path, metadata: dict[str, str] | None = None) -> None:
    """`model` as an ONNX file at `out`: fp32, input "images" (N, 3, image_size, image_size) float32
    with N dynamic, output "logits" (N, classes); `metadata` (str -> str) as its metadata_props."""
    try:
        import onnx
        import onnxscript  # noqa: F401  (torch.onnx.export's exporter needs it; said here by name)
    except ImportError as err:
        raise UsageError(f"ONNX export needs onnx and onnxscript ({err.name} is missing): {INSTALL}") from None
    import torch
    out = Path(out)
    torch.onnx.export(_fp32_copy(model), _example(image_size), str(out), input_names=["images"],
                      output_names=["logits"], dynamic_shapes=_batch_dim(), external_data=False, verbose=False)
    if metadata:
        proto = onnx.load(str(out))
        del proto.metadata_props[:]
        for key, value in metadata.items():
            proto.metadata_props.add(key=key, value=value)
        onnx.save(proto, str(out))


def export_pt2(model: torch.nn.Module, image_size: int, out: Path, metadata: dict[str, str] | None = None) -> Path:
    """`model` as a torch.export archive at `out` (torch.export.save; torch.export.load reads it back),
    the batch dimension dynamic; `metadata` inside it as extra file metadata.json and beside it as
    sidecar(out) (JSON: class_names a list, preprocessing an object, the rest strings). Returns the
    sidecar's path."""
    import torch
    out = Path(out)
    program = torch.export.export(_fp32_copy(model), _example(image_size), dynamic_shapes=_batch_dim())
    facts = _readable(metadata or {})
    torch.export.save(program, out, extra_files={"metadata.json": json.dumps(facts)})
    sidecar(out).write_text(json.dumps(facts, indent=1) + "\n")
    return sidecar(out)


def sidecar(out: Path) -> Path:
    """The JSON file beside a .pt2 export: FILE.json (model.pt2 -> model.pt2.json)."""
    return Path(f"{out}.json")


def _readable(metadata: dict[str, str]) -> dict:
    """Metadata whose values are JSON (class_names, preprocessing, evaluation) decoded, for a JSON file."""
    facts = {}
    for key, value in metadata.items():
        try:
            facts[key] = json.loads(value) if key in ("class_names", "preprocessing", "evaluation") else value
        except ValueError:
            facts[key] = value
    return facts


# the check ------------------------------------------------------------------------------------------
def check_images(trained: Trained, count: int = CHECK_IMAGES) -> tuple[torch.Tensor, str]:
    """A float32 NCHW batch of `count` validation images of the run's data (spread over the split),
    through the evaluation transform, on the CPU; and where they came from. A run without image files
    (synthetic data), or whose data is no longer there, takes the embedded dataset's (generated on
    first use)."""
    import torch

    from data.sources import open_split
    from data.tree import DataError, check_tree
    from train.inference import Images
    from train.startup import resolve_data_dir
    config = trained.config
    run_data = resolve_data_dir(SimpleNamespace(data_dir=config.get("data_dir", ""), loader=config.get("loader", "torch")))
    note = ""
    if not run_data or not Path(run_data).is_dir():
        from data.embedded import ensure_embedded
        note = (" (the run's data " + (f"{run_data} is not here" if run_data else "is synthetic") +
                ": the embedded dataset's instead)")
        run_data = str(ensure_embedded())
    try:
        source = open_split(Path(run_data), "val", check_tree(run_data), shared_writer=False)
    except (DataError, OSError) as err:
        raise UsageError(f"the check needs validation images; {run_data} has none readable ({err})") from None
    images = Images(trained.image_size, torch.device("cpu"), channels_last=False, workers=1)
    try:
        batch, slot = images.maker.empty(min(count, len(source))), 0
        for index in sorted({i * len(source) // count for i in range(count)} if len(source) > count else range(len(source))):
            if slot == len(batch):
                break
            try:
                payload, _ = source.read(index)
            except OSError:
                continue
            if not images.put(batch, slot, payload, source.name(index)):
                slot += 1
    finally:
        images.close()
    if slot == 0:
        raise UsageError(f"the check needs validation images; none of {run_data}/val's could be read")
    return images.maker.on_device(batch[:slot]).contiguous(), f"{slot} validation images of {run_data}{note}"


def run_onnx(path: Path, batch: torch.Tensor) -> torch.Tensor:
    """The logits of an ONNX file for `batch`, after onnx.checker has passed it, by ONNX Runtime."""
    import onnx
    import onnxruntime
    import torch
    onnx.checker.check_model(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"images": batch.numpy()})[0])


def run_pt2(path: Path, batch: torch.Tensor) -> torch.Tensor:
    """The logits of a .pt2 archive for `batch`, loaded back with torch.export.load."""
    import torch
    with torch.no_grad():
        return torch.export.load(str(path)).module()(batch)


def compare(expected: torch.Tensor, got: torch.Tensor) -> tuple[float, int]:
    """(largest absolute logit difference, images whose top-1 class is the same)."""
    if got.shape != expected.shape:
        return float("inf"), 0
    difference = (got.float() - expected.float()).abs().max().item()
    return difference, int((got.argmax(dim=1) == expected.argmax(dim=1)).sum())


# the command ----------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """The flags, one argument group per task, each with its help and its default said once."""
    p = CommandParser(prog="python -m train.export", usage="python -m train.export CHECKPOINT_OR_RUN --format "
                      "onnx|pt2 --out FILE [--raw-weights] [--tolerance X]", description=__doc__.split("\n\n")[0],
                      epilog="The file's input, output and metadata, and how to load it: docs/inference.md.")
    p.add_argument("source", metavar="CHECKPOINT_OR_RUN", help=f"a checkpoint file or a run directory (its {RunDir.CHECKPOINT})")
    written = p.add_argument_group("the file written")
    written.add_argument("--format", required=True, choices=("onnx", "pt2"), metavar="NAME",
                         help="onnx (torch.onnx.export, for ONNX Runtime) or pt2 (torch.export.save); required")
    written.add_argument("--out", required=True, metavar="FILE", help="the file written (pt2: FILE.json beside it "
                         "too); required")
    written.add_argument("--raw-weights", action="store_true",
                         help="the weights as trained, not the --ema-decay average the run evaluated and kept (a run "
                              "that kept no average evaluated its trained weights: they are taken either way)")
    check = p.add_argument_group("the check against the PyTorch model")
    check.add_argument("--tolerance", type=float, default=TOLERANCE, metavar="X",
                       help="largest absolute logit difference allowed; above it the file is removed and the exit "
                            f"status is 1 (default: {TOLERANCE:g})")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return export(parse(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def export(args: argparse.Namespace) -> int:
    import torch

    from train.inference import export_metadata, load_trained
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: its folder {out.parent} does not exist; create it or choose another")
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; give a file name")
    trained = load_trained(args.source, torch.device("cpu"), args.raw_weights)
    metadata = export_metadata(trained)
    written = [out]
    if args.format == "onnx":
        export_onnx(trained.model, trained.image_size, out, metadata)
    else:
        written.append(export_pt2(trained.model, trained.image_size, out, metadata))
    size = out.stat().st_size
    weights = "its --ema-decay average" if trained.averaged else "its trained weights"
    print(f"wrote {out} ({size / 1e6:.1f} MB): {trained.arch} from {trained.checkpoint} ({weights}), "
          f"{len(trained.class_names)} classes, input images float32 (N, 3, {trained.image_size}, {trained.image_size}), "
          "output logits, fp32" + (f"; metadata in {written[1]}" if len(written) > 1 else "")
          + ("; the run's evaluation also averaged each image's logits with its mirror image's (metadata "
             "'evaluation')" if trained.flip else ""), flush=True)

    batch, described = check_images(trained)
    with torch.no_grad():
        expected = _fp32_copy(trained.model)(batch)
    try:
        got = run_onnx(out, batch) if args.format == "onnx" else run_pt2(out, batch)
        difference, agreeing = compare(expected, got)
        problem = f"{difference:.2e} > {args.tolerance:g}" if not difference <= args.tolerance else ""
    except Exception as err:  # the checker's, the runtime's or the loader's refusal: the file is no good
        difference, agreeing, problem = float("inf"), 0, f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
    runner = "ONNX Runtime (after onnx.checker)" if args.format == "onnx" else "torch.export.load"
    n = len(batch)
    print(f"check: {runner} against the PyTorch model on {described}: largest logit difference {difference:.2e}, "
          f"top-1 {'the same on every image' if agreeing == n else f'the same on {agreeing} of {n} images'}", flush=True)
    if problem:
        for path in written:
            path.unlink(missing_ok=True)
        print(f"error: the export does not match the model ({problem}); {', '.join(map(str, written))} removed",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
