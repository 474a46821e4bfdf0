"""Prepare ImageNet (ILSVRC2012) from the official files into an ImageFolder tree, and shards on request.

    python scripts/prepare_imagenet.py --train-tar ILSVRC2012_img_train.tar \\
        --val-tar ILSVRC2012_img_val.tar --devkit ILSVRC2012_devkit_t12.tar.gz --out DIR [--shards]

Produces DIR/train/<wnid>/*.JPEG, DIR/val/<wnid>/*.JPEG (validation images placed by the devkit's
ground truth: 1-based ILSVRC ids mapped to WordNet ids through data/meta.mat), DIR/manifest.tsv
(split, path, bytes, sha256, what was converted) and, with --shards, DIR/shards/. CMYK JPEGs and
files of other formats under a .JPEG name are re-encoded as RGB JPEG. The counts are checked
against the official 1,281,167 / 50,000 / 1000 before anything is written; a difference is an
error unless --allow-partial. With --allow-partial, validation images of classes that have no
training archive are left out (the loaders need the same classes in train/ and val/); the summary
line after "prepared ..." says how many, of how many classes. An interrupted run resumes: finished
classes are kept, a class is only made visible (renamed into place) once all its images are written.
A file that is not a tar archive is named in a one-line error (exit 2). Every few seconds a line
says how far the long steps are (reading the training archive, extracting, placing the validation
images, indexing, writing shards), with an ETA where the total is known.
"""
import argparse
import hashlib
import io
import os
import re
import shutil
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.index import RACY_NS, load_samples  # noqa: E402
from data.progress import Progress  # noqa: E402
from data.shards import write_shards  # noqa: E402
from data.tree import check_tree  # noqa: E402

OFFICIAL = {"train": 1_281_167, "val": 50_000, "classes": 1000}


class PrepareError(Exception):
    pass


def open_tar(what: str, fileobj=None) -> tarfile.TarFile:
    """The tar archive named by what (or read from fileobj), or an error that names it: tarfile's own
    message is several lines, one per compression tried, and names no file."""
    try:
        return tarfile.open(None if fileobj else what, fileobj=fileobj)
    except tarfile.ReadError:
        raise PrepareError(f"{what} is not a tar archive; pass the official ILSVRC2012 files") from None


def read_devkit(devkit: Path) -> tuple[dict[int, str], list[int]]:
    """{ILSVRC id: wnid} of the 1000 leaf classes, and the validation ground truth (ids, in file order)."""
    from scipy.io import loadmat
    with open_tar(str(devkit)) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers()}
        for needed in ("meta.mat", "ILSVRC2012_validation_ground_truth.txt"):
            if needed not in members:
                raise PrepareError(f"{devkit} has no data/{needed}; is it ILSVRC2012_devkit_t12.tar.gz?")
        meta = loadmat(io.BytesIO(tar.extractfile(members["meta.mat"]).read()), squeeze_me=True)["synsets"]
        truth = tar.extractfile(members["ILSVRC2012_validation_ground_truth.txt"]).read().decode().split()
    wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in meta if int(s["num_children"]) == 0}
    return wnid_of, [int(t) for t in truth]


def val_classes(val_members: list, truth: list[int], wnid_of: dict[int, str]) -> list[str]:
    """The wnid of each validation image, by the number in its name (ILSVRC2012_val_00000001.JPEG has the first label)."""
    wnids = []
    for member in val_members:
        match = re.search(r"(\d+)\.\w+$", member.name)
        class_id = truth[int(match.group(1)) - 1] if match and 1 <= int(match.group(1)) <= len(truth) else None
        if class_id not in wnid_of:
            raise PrepareError(f"{member.name} of the validation archive has no class in the devkit's ground truth")
        wnids.append(wnid_of[class_id])
    return wnids


def normalise(payload: bytes) -> tuple[bytes, str]:
    """The image as a JPEG PIL can read in RGB or grayscale; other formats and CMYK re-encoded."""
    with Image.open(io.BytesIO(payload)) as image:
        if image.format == "JPEG" and image.mode in ("RGB", "L"):
            return payload, ""
        what = f"{image.format} {image.mode}"
        out = io.BytesIO()
        image.convert("RGB").save(out, format="JPEG", quality=95)
        return out.getvalue(), f"converted {what} to RGB JPEG"


def write_image(folder: Path, name: str, payload: bytes, manifest: list[str], split: str, out: Path) -> None:
    try:
        payload, note = normalise(payload)
    except OSError:
        note = "unreadable, kept as is"  # the loaders skip and count it
    (folder / name).write_bytes(payload)
    final = Path(split) / folder.name.removesuffix(".partial") / name
    manifest.append(f"{split}\t{final}\t{len(payload)}\t{hashlib.sha256(payload).hexdigest()}\t{note}")


def prepare(args) -> None:
    for path in (args.train_tar, args.val_tar, args.devkit):
        if not Path(path).is_file():
            raise PrepareError(f"{path} does not exist; pass the official ILSVRC2012 files")
    wnid_of, truth = read_devkit(Path(args.devkit))
    out = Path(args.out)
    with open_tar(args.train_tar) as train_tar, open_tar(args.val_tar) as val_tar:
        class_tars = sorted((m for m in train_tar.getmembers() if m.name.endswith(".tar")), key=lambda m: m.name)
        images_per_class = {}
        reading = Progress(f"counting the images of {args.train_tar}", total=len(class_tars), unit="class archives")
        for number, member in enumerate(class_tars, start=1):  # headers only: tarfile seeks past the image bytes
            with open_tar(f"{member.name} in {args.train_tar}", train_tar.extractfile(member)) as inner:
                images_per_class[Path(member.name).stem] = sum(1 for m in inner.getmembers() if m.isfile())
            reading.tick(number)
        val_members = sorted((m for m in val_tar.getmembers() if m.isfile()), key=lambda m: m.name)
        counts = {"train": sum(images_per_class.values()), "val": len(val_members), "classes": len(class_tars)}
        differences = [f"{k} {counts[k]:,} (official {OFFICIAL[k]:,})" for k in OFFICIAL if counts[k] != OFFICIAL[k]]
        if len(truth) != len(val_members):
            raise PrepareError(f"the devkit has {len(truth)} ground-truth labels for {len(val_members)} validation images")
        val_wnids = val_classes(val_members, truth, wnid_of)
        # A class subset (--allow-partial): validation images of classes without training data would
        # give val/ classes that train/ lacks, a tree the loaders refuse; they are left out and counted.
        placed = [(m, wnid) for m, wnid in zip(val_members, val_wnids) if wnid in images_per_class]
        left_out = Counter(wnid for wnid in val_wnids if wnid not in images_per_class)
        if set(images_per_class) - set(wnid_of.values()):
            raise PrepareError("training classes that the devkit does not list: "
                               f"{sorted(set(images_per_class) - set(wnid_of.values()))[:3]}")
        if differences and not args.allow_partial:
            raise PrepareError(f"counts differ from ILSVRC2012: {'; '.join(differences)}; pass --allow-partial to go on")
        if differences:
            print(f"warning: counts differ from ILSVRC2012: {'; '.join(differences)}", file=sys.stderr)

        (out / "train").mkdir(parents=True, exist_ok=True)
        manifests = out / ".manifests"
        manifests.mkdir(exist_ok=True)
        finished = {wnid for wnid in images_per_class  # by an earlier run
                    if (out / "train" / wnid).is_dir() and (manifests / f"train-{wnid}.tsv").is_file()}
        to_write = sum(images_per_class.values()) - sum(images_per_class[wnid] for wnid in finished)
        extracting, written = Progress("extracting training images", total=to_write, unit="files"), 0
        for member in class_tars:
            wnid = Path(member.name).stem
            if wnid in finished:
                continue
            partial = out / "train" / f"{wnid}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            lines = []
            with tarfile.open(fileobj=train_tar.extractfile(member)) as inner:
                for image in sorted((m for m in inner.getmembers() if m.isfile()), key=lambda m: m.name):
                    write_image(partial, Path(image.name).name, inner.extractfile(image).read(), lines, "train", out)
                    written += 1
                    extracting.tick(written)
            (manifests / f"train-{wnid}.tsv.partial").write_text("".join(f"{line}\n" for line in lines))
            os.replace(partial, out / "train" / wnid)  # the class becomes visible whole
            os.replace(manifests / f"train-{wnid}.tsv.partial", manifests / f"train-{wnid}.tsv")
        if finished:
            print(f"resumed: {len(finished)} finished class(es) kept")

        if not (manifests / "val.tsv").is_file():
            partial = out / "val.partial"
            shutil.rmtree(partial, ignore_errors=True)
            for wnid in sorted(images_per_class):
                (partial / f"{wnid}.partial").mkdir(parents=True)
            lines, placing = [], Progress("placing validation images", total=len(placed), unit="files")
            for member, wnid in placed:
                write_image(partial / f"{wnid}.partial", Path(member.name).name, val_tar.extractfile(member).read(),
                            lines, "val", out)
                placing.tick(len(lines))
            for folder in partial.iterdir():
                folder.rename(partial / folder.name.removesuffix(".partial"))
            shutil.rmtree(out / "val", ignore_errors=True)
            os.replace(partial, out / "val")
            (manifests / "val.tsv").write_text("".join(f"{line}\n" for line in lines))

    with open(out / "manifest.tsv", "w") as manifest:
        manifest.write("split\tpath\tbytes\tsha256\tnote\n")
        for part in sorted(manifests.glob("train-*.tsv")) + [manifests / "val.tsv"]:
            manifest.write(part.read_text())
    write_index(out)
    print(f"prepared {counts['train']:,} training and {len(placed):,} validation images of "
          f"{counts['classes']} classes in {out}")
    if left_out:
        print(f"{sum(left_out.values()):,} validation images of {len(left_out)} classes without training data left out "
              f"(first: {', '.join(sorted(left_out)[:3])})")
    if args.shards:
        written = write_shards(out, out / "shards", args.shard_size)
        print(f"wrote shards of {written['train']:,} + {written['val']:,} samples to {out / 'shards'}")


def write_index(out: Path) -> None:
    """The sample index of both splits (data/index.py), so that no rank of a run walks the tree. An
    index of folders changed within the last second is not trusted, hence the pause."""
    time.sleep(RACY_NS / 1e9)
    classes = check_tree(str(out))
    for split in ("train", "val"):
        load_samples(out / split, classes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-tar", required=True)
    parser.add_argument("--val-tar", required=True)
    parser.add_argument("--devkit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shards", action="store_true", help="also write tar shards to OUT/shards")
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--allow-partial", action="store_true", help="report count differences and go on")
    args = parser.parse_args()
    try:
        prepare(args)
    except (PrepareError, tarfile.TarError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
