"""Tar shards in the webdataset layout: NNNNNN.jpg + NNNNNN.cls members, one index file per shard.

The index is DALI's (`wds2idx`, format v1.2): a header "v1.2 <samples>", then one line per sample
listing "<ext> <data offset> <size> <member name>" for each of its members. DALI's
fn.readers.webdataset takes it as index_paths, and the torch loader uses it for random access.
Shards hold the samples the trainer lists for the tree (data/loaders.py list_samples), in its order,
with fixed member metadata, so the same tree always gives byte-identical shards. classes.txt beside
the splits names the classes, one per line in UTF-8 (a name may hold spaces). Beside each shard,
shard-NNNNNN.names lists the source file of each of its samples (one JSON string a line, absolute
paths as they were when the shards were written), so that a file the loaders skip is named as the
user knows it, not as a shard member; shards written without it are named by member. Each split's
class_counts.json holds its samples per class (a JSON list in class order), so that a class with no
images is found without a pass over the shards; shards written without it are not checked for one.
"""
import bisect
import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

from data.progress import Progress
from data.tree import DataError, check_tree, list_samples, write_classes

INDEX_VERSION = "v1.2"
_SHARD_FILE = re.compile(r"shard-\d{6}\.(tar|idx|names|tar\.partial)|class_counts\.json")  # what write_shards writes (.partial: older versions)
CLASS_COUNTS = "class_counts.json"


def _member(tar: tarfile.TarFile, name: str, payload: bytes) -> tuple[int, int]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = tar.offset
    tar.addfile(info, io.BytesIO(payload))  # a short USTAR name: one 512-byte header block
    return header + tarfile.BLOCKSIZE, info.size


def _holds_only_shards(out: Path) -> bool:
    """Whether a folder holds nothing but what write_shards writes, so that replacing it loses nothing else."""
    for entry in out.iterdir():
        if entry.name == "classes.txt":
            continue
        if entry.name in ("train", "val") and entry.is_dir() and not entry.is_symlink() and \
                all(_SHARD_FILE.fullmatch(f.name) for f in entry.iterdir()):
            continue
        return False
    return True


def _is_mount_point(folder: Path) -> bool:
    """Also a bind mount within one filesystem, which os.path.ismount misses (same device as its parent)."""
    if os.path.ismount(folder):
        return True
    try:
        with open("/proc/self/mountinfo", "rb") as mounts:  # field 5: the mount point, with \NNN octal escapes
            points = {re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split()[4]) for line in mounts}
    except OSError:  # not Linux
        return False
    return os.fsencode(os.path.realpath(folder)) in points


def _write_split(samples: list[tuple[str, int]], classes: list[str], split_dir: Path, shard_size: int,
                 unreadable: list[str]) -> list[int]:
    """The split's shards, saying every few seconds how many files are written of how many; returns
    its samples per class."""
    progress = Progress(f"writing {split_dir.name} shards", total=len(samples), unit="files")
    split_dir.mkdir()
    counts = [0] * len(classes)
    for _, label in samples:
        counts[label] += 1
    (split_dir / CLASS_COUNTS).write_text(json.dumps(counts) + "\n")
    for first in range(0, len(samples), shard_size):
        stem = split_dir / f"shard-{first // shard_size:06d}"
        lines, names = [], []
        with tarfile.open(f"{stem}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for number, (path, label) in enumerate(samples[first:first + shard_size], start=first):
                try:
                    payload = Path(path).read_bytes()
                except OSError:  # a broken link, say: stored empty, so the loaders skip and count it as in the tree
                    payload = b""
                    unreadable.append(path)
                key = f"{number:06d}"
                jpg = _member(tar, f"{key}.jpg", payload)
                cls = _member(tar, f"{key}.cls", str(label).encode())
                lines.append(f"jpg {jpg[0]} {jpg[1]} {key}.jpg cls {cls[0]} {cls[1]} {key}.cls")
                names.append(json.dumps(os.path.abspath(path)))
                progress.tick(number + 1)
        Path(f"{stem}.idx").write_text(f"{INDEX_VERSION} {len(lines)}\n" + "\n".join(lines) + "\n")
        Path(f"{stem}.names").write_text("\n".join(names) + "\n", encoding="utf-8")
    return counts


def write_shards(tree: Path, out: Path, shard_size: int = 1000) -> dict:
    """Shards of both splits of an ImageFolder tree: {"train": count, "val": count, "unreadable": [paths
    stored empty], "empty": [classes without training images]}. The set is written into a sibling folder and renamed into place at the end, so `out`
    holds its old set or the whole new one, never a mix; a folder holding anything else is refused.
    Every few seconds a line on stdout says how far the listing and the writing are (data/progress.py)."""
    tree, out = Path(tree), Path(os.path.abspath(out))
    classes = check_tree(str(tree))
    if any("\n" in name for name in classes):
        raise DataError(f"a class folder name in {tree / 'train'} holds a line break; classes.txt cannot list it")
    if out.is_symlink() or (out.exists() and not (out.is_dir() and _holds_only_shards(out))):
        raise DataError(f"{out} exists and holds more than shards; pass a new folder or one of shards to replace")
    if _is_mount_point(out):
        raise DataError(f"{out} is a mount point; a new set is written beside it and renamed into place, "
                        "so pass a folder inside it")
    new, old = out.with_name(f".{out.name}.partial"), out.with_name(f".{out.name}.old")
    shutil.rmtree(new, ignore_errors=True)  # left by a run that was killed
    try:
        new.mkdir(parents=True)
    except OSError as err:  # a read-only folder (EROFS) or another user's (EACCES): nothing written yet
        raise DataError(f"cannot write shards into {out.parent} ({err.strerror}); pass an --out in a folder "
                        "you can write") from err
    counts = {"unreadable": []}
    try:
        for split in ("train", "val"):
            samples = list_samples(tree / split, classes, progress=Progress(f"listing {tree / split}", unit="files found"))
            per_class = _write_split(samples, classes, new / split, shard_size, counts["unreadable"])
            counts[split] = len(samples)
            if split == "train":
                counts["empty"] = [name for name, count in zip(classes, per_class) if count == 0]
        write_classes(new, classes)
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(new, out)
    finally:
        if old.exists() and not out.exists():  # stopped between the two renames: the old set goes back
            os.replace(old, out)
        shutil.rmtree(new, ignore_errors=True)  # gone already unless the writing failed
    shutil.rmtree(old, ignore_errors=True)
    return counts


def read_index(tar_path: Path) -> list[dict]:
    """Per sample: {ext: (offset, size)} from the shard's .idx file."""
    lines = Path(tar_path).with_suffix(".idx").read_text().splitlines()
    version, count = lines[0].split()
    if version != INDEX_VERSION or int(count) != len(lines) - 1:
        raise ValueError(f"{tar_path}: index is not a {INDEX_VERSION} index of {count} samples")
    samples = []
    for line in lines[1:]:
        fields = line.split()
        samples.append({fields[i]: (int(fields[i + 1]), int(fields[i + 2])) for i in range(0, len(fields), 4)})
    return samples


class ShardSamples:
    """Random access to the (jpg bytes, label) samples of one split's shards."""

    def __init__(self, split_dir: Path):
        self.split_dir = split_dir
        self.tars = sorted(Path(split_dir).glob("*.tar"))
        self.entries, self.firsts = [], []  # firsts: each shard's first index
        for tar in self.tars:
            self.firsts.append(len(self.entries))
            self.entries += [(tar, sample) for sample in read_index(tar)]

    def __len__(self) -> int:
        return len(self.entries)

    def class_counts(self) -> list[int] | None:
        """Samples per class, as write_shards counted them (None: shards written without the count)."""
        try:
            counts = json.loads((Path(self.split_dir) / CLASS_COUNTS).read_text())
        except (OSError, ValueError):
            return None
        return counts if isinstance(counts, list) and all(isinstance(n, int) for n in counts) else None

    def name(self, index: int) -> str:
        """The sample's source file (from the shard's .names), else its member in the shard."""
        tar, _ = self.entries[index]
        within = index - self.firsts[bisect.bisect_right(self.firsts, index) - 1]
        try:
            with open(Path(tar).with_suffix(".names"), encoding="utf-8") as names:
                for number, line in enumerate(names):
                    if number == within:
                        return f"{json.loads(line)} (in {Path(tar).name})"
        except (OSError, ValueError):  # shards written before .names, or a damaged one
            pass
        return f"{tar}:{index:06d}.jpg"

    def read(self, index: int) -> tuple[bytes, int]:
        tar, sample = self.entries[index]
        (jpg_offset, jpg_size), (cls_offset, cls_size) = sample["jpg"], sample["cls"]
        # a handle per read: safe across loader threads, and a thousand shards stay under the descriptor limit
        with open(tar, "rb", buffering=0) as f:
            span = os.pread(f.fileno(), cls_offset + cls_size - jpg_offset, jpg_offset)  # the label follows the image
        return span[:jpg_size], int(span[cls_offset - jpg_offset:])
