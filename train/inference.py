"""The trained model in use: a run's checkpoint loaded for inference (`load_trained`), image files
turned into the batches the model takes with the evaluation transform of training (`Images`), the
logits the run's evaluation takes of them (`evaluated_logits`: with --eval-flip, the mean with the
mirror image's), and the facts an exported model carries (`preprocessing`, `export_metadata`).
`python -m train.predict` and `python -m train.export` are built on these (docs/inference.md).

The transform is the data package's, not a copy: data/torch_loader.py's EvalCrop (the shorter side
resized to size / 0.875, data/loaders.py's eval_geometry, then the centre crop) over data/decode.py's
decoder, then its BatchMaker's normalisation with IMAGENET_MEAN / IMAGENET_STD. The pixels, and so
the logits, are --test-only's.
"""
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data.decode import BadImage, Encoded
from data.loaders import EVAL_CROP_FRACTION, IMAGENET_MEAN, IMAGENET_STD
from data.torch_loader import BatchMaker, EvalCrop, _one_intra_op_thread
from data.tree import IMAGE_EXTENSIONS
from models import ARCHS, build_model, first_misfit
from train import checkpoint
from train.errors import UsageError
from train.rundir import RunDir, current_keys


@dataclass
class Trained:
    """A run's model ready for inference: --arch's model with the checkpoint's weights (the ones the
    run evaluated, or with `raw` the trained ones), in eval mode, fp32, on the device asked for; the
    class names by index; the run's evaluation size, whether its evaluation averaged flips, and its
    precision (as its config recorded it: auto resolves on the device, train/precision.py)."""
    model: torch.nn.Module
    class_names: list[str]
    arch: str
    image_size: int
    precision: str
    checkpoint: Path
    config: dict = field(default_factory=dict, repr=False)  # the run's whole config, as saved
    flip: bool = False  # the run evaluated with --eval-flip
    averaged: bool = False  # the weights are the run's --ema-decay average, not the trained ones


WHAT_TO_DO = f"give a checkpoint of this trainer (a run's {RunDir.CHECKPOINT} or a kept copy) or its run directory"


def checkpoint_of(source: str | Path) -> Path:
    """The checkpoint file `source` names: itself, or a run directory's checkpoint.pt."""
    path = Path(source)
    if path.is_dir():
        run_dir = RunDir(path)
        if not run_dir.checkpoint.is_file():
            kept = [p.name for p in run_dir.checkpoints()]
            also = f" (it holds {', '.join(kept)}: give one of them as a file)" if kept else ""
            raise UsageError(f"{path} holds no {RunDir.CHECKPOINT}{also}; {WHAT_TO_DO}")
        return run_dir.checkpoint
    if not path.exists():
        raise UsageError(f"{path} does not exist; {WHAT_TO_DO}")
    return path


def load_trained(source: str | Path, device: torch.device, raw: bool = False) -> Trained:
    """The model of a checkpoint file, or of a run directory's checkpoint.pt (a kept copy such as
    checkpoint-best.pt is given as a file), read as plain data only (train/checkpoint.py load): the
    weights the run evaluated (its --ema-decay average where it kept one), or with `raw`
    (--raw-weights) the trained weights. A missing path, a file that is no checkpoint of this trainer,
    or weights that the recorded --arch does not build: a UsageError of one line naming the problem
    and what to do."""
    path = checkpoint_of(source)
    state = checkpoint.load(path, torch.device("cpu"), WHAT_TO_DO)
    config = current_keys(state.get("config")) if isinstance(state.get("config"), dict) else {}
    arch, weights = config.get("arch"), checkpoint.evaluated_weights(state, raw)
    if arch not in ARCHS:
        raise UsageError(f"{path} records no model this trainer builds (arch {arch!r}); {WHAT_TO_DO}")
    fc = weights.get("fc.weight")
    num_classes = fc.shape[0] if isinstance(fc, torch.Tensor) and fc.dim() == 2 else 0
    differing = first_misfit(weights, arch, num_classes or 1000)
    if differing:
        raise UsageError(f"{path} records arch {arch}, but its weights are not a {arch}'s ({differing} differs); "
                         f"the file was changed or mixed up: {WHAT_TO_DO}")
    model = build_model(arch, num_classes, channels_last=bool(config.get("channels_last", False)),
                        blurpool=config.get("blurpool") is True)
    model.load_state_dict(weights)
    model = model.float().eval().to(device)
    names = state.get("classes")
    if not (isinstance(names, list) and len(names) == num_classes and all(isinstance(n, str) for n in names)):
        names = [str(i) for i in range(num_classes)]  # synthetic data has no names (nor did older checkpoints)
    size = int(config.get("eval_image_size") or config.get("image_size", 224))  # (the run's evaluation size)
    return Trained(model=model, class_names=list(names), arch=arch, image_size=size,
                   precision=str(config.get("precision", "fp32")), checkpoint=path, config=config,
                   flip=config.get("eval_flip") is True, averaged=weights is not state["model"])


# the logits the run's evaluation takes -----------------------------------------------------------
FLIP_HOW = "mean of the logits of the image and its left-right mirror"  # train/evaluate.py evaluate, --eval-flip


def evaluated_logits(logits_of, batch: torch.Tensor, flip: bool) -> torch.Tensor:
    """The logits of an NCHW `batch` as the run's evaluation takes them (train/evaluate.py, predict,
    bench infer): `logits_of(batch)`, and with `flip` their mean with the logits of the batch mirrored
    left to right."""
    logits = logits_of(batch)
    return (logits + logits_of(batch.flip(3))) / 2 if flip else logits


def evaluation(flip: bool) -> dict:
    """How the run's evaluation turned a model's logits into its classes, for an exported model's
    metadata ("evaluation"): flip, and how."""
    return {"flip": flip, "how": FLIP_HOW if flip else "the logits of the image alone"}


# the evaluation transform, as data -------------------------------------------------------------
def preprocessing(image_size: int) -> dict:
    """What an exported model's input is, for programs that feed it without this package: RGB
    pixels / 255, the shorter side resized (bilinear, antialiased) to `resize`, the centre `crop`
    taken, then (x - mean) / std per channel, as a float32 NCHW batch."""
    return {"resize": round(image_size / EVAL_CROP_FRACTION), "crop": image_size, "crop_fraction": EVAL_CROP_FRACTION,
            "interpolation": "bilinear, antialiased", "scale": "1/255", "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD), "channel_order": "RGB", "layout": "NCHW", "dtype": "float32"}


def export_metadata(trained: Trained) -> dict[str, str]:
    """The facts an exported model carries (ONNX metadata_props; the JSON beside a .pt2), each a
    string: class_names, preprocessing and evaluation (JSON), which weights, and where it came from."""
    return {"class_names": json.dumps(trained.class_names), "preprocessing": json.dumps(preprocessing(trained.image_size)),
            "evaluation": json.dumps(evaluation(trained.flip)), "weights": "ema_average" if trained.averaged else "trained",
            "arch": trained.arch, "image_size": str(trained.image_size), "source_checkpoint": str(trained.checkpoint),
            "trained_precision": trained.precision}


def flip_of(evaluation_json: str | None, where: str) -> bool:
    """Whether an exported model's `evaluation` metadata says the run averaged flips (False, said on
    stderr, where the export has none: files written before it was recorded)."""
    if evaluation_json is None:
        print(f"note: {where} has no 'evaluation' metadata (an older export): classified without flips; give "
              "--flip if its run evaluated with --eval-flip", file=sys.stderr)
        return False
    try:
        flip = json.loads(evaluation_json)["flip"]
    except (ValueError, TypeError, KeyError):
        flip = None
    if not isinstance(flip, bool):
        raise UsageError(f"{where}'s 'evaluation' metadata is not readable ({evaluation_json[:80]!r}); "
                         "export it again with python -m train.export, or give --flip or --no-flip")
    return flip


def image_size_of(preprocessing_json: str, where: str) -> int:
    """The crop size of an exported model's `preprocessing`, which must be this trainer's evaluation
    transform (the only one Images applies)."""
    try:
        facts = json.loads(preprocessing_json)
        size = int(facts["crop"])
    except (ValueError, TypeError, KeyError):
        raise UsageError(f"{where} has no readable 'preprocessing' metadata; export it with python -m train.export") from None
    expected = preprocessing(size)
    differing = [key for key in ("resize", "crop", "mean", "std", "channel_order", "layout") if facts.get(key) != expected[key]]
    if differing:
        raise UsageError(f"{where}'s preprocessing is not this trainer's evaluation transform at size {size} "
                         f"({', '.join(differing)} differ); export it with python -m train.export")
    return size


# image files to batches -------------------------------------------------------------------------
def find_images(paths: list[str | Path]) -> list[Path]:
    """The image files named or found (recursively, links followed) under `paths`: files with an image
    extension as the data package lists them (data/tree.py IMAGE_EXTENSIONS), each folder's in sorted
    order; a file named on its own is taken whatever its name. A path that does not exist: UsageError."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            for root, dirs, files in os.walk(path, followlinks=True):
                dirs.sort()
                found += [Path(root) / name for name in sorted(files) if name.lower().endswith(IMAGE_EXTENSIONS)]
        elif path.exists() or path.is_symlink():
            found.append(path)
        else:
            raise UsageError(f"{path} does not exist; give image files or folders of them")
    return list(dict.fromkeys(found))


class Images:
    """Image files as the model's input batches, each image through the evaluation transform of
    training (decoded as the loader decodes, EvalCrop, BatchMaker's normalisation), decoded by a few
    threads. `batches` yields (paths, batch on the device); files that cannot be read or decoded are
    left out and reported through `on_skipped(path, why)`."""

    def __init__(self, image_size: int, device: torch.device, channels_last: bool = False, workers: int = 0):
        self.crop = EvalCrop(image_size)
        self.maker = BatchMaker(image_size, device, channels_last)
        workers = workers or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="decode", initializer=_one_intra_op_thread)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _slot(self, batch: torch.Tensor, slot: int, path: Path) -> str:
        """The crop of `path` put in its slot; "" when done, else why the file was skipped."""
        try:
            payload = path.read_bytes()
        except OSError as err:
            return f"cannot be read ({err.strerror or err})"
        return self.put(batch, slot, payload, str(path))

    def put(self, batch: torch.Tensor, slot: int, payload: bytes, name: str) -> str:
        """An encoded image's crop put in its slot of a batch from `self.maker.empty`; "" when done,
        else why it was left out."""
        if not payload:
            return "empty file"
        try:
            pixels = self.crop(Encoded(payload, name))
        except BadImage as err:
            return _unreadable(err.__cause__ or err)
        except (OSError, ValueError, RuntimeError) as err:  # a decoder's own failure past the header
            return _unreadable(err)
        self.maker.put(batch, slot, pixels)
        return ""

    def batches(self, paths: list[Path], batch_size: int, on_skipped):
        for start in range(0, len(paths), batch_size):
            chunk = paths[start:start + batch_size]
            batch = self.maker.empty(len(chunk))
            whys = list(self.pool.map(lambda item: self._slot(batch, *item), enumerate(chunk)))
            for path, why in zip(chunk, whys):
                if why:
                    on_skipped(path, why)
            good = [i for i, why in enumerate(whys) if not why]
            if not good:
                continue
            if len(good) < len(chunk):
                batch = batch[good]
            yield [chunk[i] for i in good], self.maker.on_device(batch)


def _unreadable(err: Exception) -> str:
    detail = str(err).splitlines()[0] if str(err).strip() else ""
    detail = "" if "<" in detail else f": {detail}"  # (PIL names its file object: nothing to a reader)
    return f"not a readable image ({type(err).__name__}{detail})"
