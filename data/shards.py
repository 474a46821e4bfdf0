"""Tar shards in the webdataset layout: NNNNNN.jpg + NNNNNN.cls members, one index file per shard.

The index is DALI's (`wds2idx`, format v1.2): a header "v1.2 <samples>", then one line per sample
listing "<ext> <data offset> <size> <member name>" for each of its members. DALI's
fn.readers.webdataset takes it as index_paths, and the torch loader uses it for random access.
Shards are written in a fixed order (class, then file name) with fixed member metadata, so the
same tree always gives byte-identical shards. classes.txt beside the splits names the classes.
"""
import io
import os
import tarfile
from pathlib import Path

INDEX_VERSION = "v1.2"


def _member(tar: tarfile.TarFile, name: str, payload: bytes) -> tuple[int, int]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(payload), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = tar.offset
    tar.addfile(info, io.BytesIO(payload))  # a short USTAR name: one 512-byte header block
    return header + tarfile.BLOCKSIZE, info.size


def write_shards(tree: Path, out: Path, shard_size: int = 1000, splits=("train", "val")) -> dict:
    """Shards of every split of an ImageFolder tree; returns {split: sample count}."""
    tree, out = Path(tree), Path(out)
    classes = sorted(entry.name for entry in os.scandir(tree / splits[0]) if entry.is_dir())
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in splits:
        samples = [(tree / split / cls / name, label) for label, cls in enumerate(classes)
                   for name in sorted(os.listdir(tree / split / cls)) if not name.startswith(".")]
        (out / split).mkdir(exist_ok=True)
        for first in range(0, len(samples), shard_size):
            stem = out / split / f"shard-{first // shard_size:06d}"
            lines = []
            with tarfile.open(f"{stem}.tar.partial", "w", format=tarfile.USTAR_FORMAT) as tar:
                for number, (path, label) in enumerate(samples[first:first + shard_size], start=first):
                    key = f"{number:06d}"
                    jpg = _member(tar, f"{key}.jpg", Path(path).read_bytes())
                    cls = _member(tar, f"{key}.cls", str(label).encode())
                    lines.append(f"jpg {jpg[0]} {jpg[1]} {key}.jpg cls {cls[0]} {cls[1]} {key}.cls")
            Path(f"{stem}.idx").write_text(f"{INDEX_VERSION} {len(lines)}\n" + "\n".join(lines) + "\n")
            os.replace(f"{stem}.tar.partial", f"{stem}.tar")
        counts[split] = len(samples)
    (out / "classes.txt").write_text("\n".join(classes) + "\n")
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


def is_shard_tree(data_dir) -> bool:
    return (Path(data_dir) / "classes.txt").is_file() and any(Path(data_dir, "train").glob("*.tar"))


class ShardSamples:
    """Random access to the (jpg bytes, label) samples of one split's shards."""

    def __init__(self, split_dir: Path):
        self.tars = sorted(Path(split_dir).glob("*.tar"))
        self.entries = [(t, sample) for t in self.tars for sample in read_index(t)]

    def __len__(self) -> int:
        return len(self.entries)

    def name(self, index: int) -> str:
        tar, sample = self.entries[index]
        return f"{tar}:{index:06d}.jpg"

    def read(self, index: int) -> tuple[bytes, int]:
        tar, sample = self.entries[index]
        (jpg_offset, jpg_size), (cls_offset, cls_size) = sample["jpg"], sample["cls"]
        # a handle per read: safe across loader threads, and a thousand shards stay under the descriptor limit
        with open(tar, "rb", buffering=0) as f:
            span = os.pread(f.fileno(), cls_offset + cls_size - jpg_offset, jpg_offset)  # the label follows the image
        return span[:jpg_size], int(span[cls_offset - jpg_offset:])
