"""Write tar shards (webdataset layout, DALI index per shard) from an ImageFolder tree.

    python scripts/make_shards.py --src DATA_DIR --out SHARD_DIR [--shard-size 1000]

DATA_DIR holds train/<class>/* and val/<class>/*; SHARD_DIR gets train/shard-NNNNNN.{tar,idx},
val/..., and classes.txt. `python -m train --data-dir SHARD_DIR` reads them.

The shards hold exactly the samples the trainer reads from DATA_DIR, in its order (one listing for
both: data/loaders.py list_samples); a file that cannot be read at all (a broken link) is stored
empty, so the loaders skip and count it as they would in the tree.

Writing into a SHARD_DIR that already holds shards replaces the whole set: the new set is written
into a sibling folder (.SHARD_DIR.partial) and renamed into place at the end, the old one renamed
aside first and removed after. So SHARD_DIR never holds a mix of old and new shards or a half-written
set, and a failed run leaves the old set as it was and no partial files. A SHARD_DIR that holds
anything besides shards is refused (`error: ...`, exit 2) rather than deleted, and so is one that is
DATA_DIR itself or inside its train/ or val/ (it would become a class folder there; elsewhere inside
DATA_DIR, as prepare_imagenet.py's DATA_DIR/shards, it is left out of the listing). A SHARD_DIR that
cannot be written (a read-only folder) is one line, exit 2, as well.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.tree import DataError, is_shard_tree  # noqa: E402
from data.shards import write_shards  # noqa: E402


def check_folders(src: str, out: str) -> None:
    """--src an existing folder, and --out not a folder the tree's listing would take in."""
    if not Path(src).is_dir():
        raise DataError(f"--src {src} is no folder; pass the ImageFolder tree to shard (train/<class>/*, val/<class>/*)")
    src_real, out_real = Path(os.path.realpath(src)), Path(os.path.realpath(out))
    if out_real == src_real:
        raise DataError(f"--out {out} is --src itself; pass another folder for the shards")
    for split in ("train", "val"):
        if out_real.is_relative_to(src_real / split):
            raise DataError(f"--out {out} is inside --src's {split}/ folder, where it would become a class; "
                            "pass an --out outside the tree's train/ and val/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    args = parser.parse_args()
    try:
        if args.shard_size <= 0:
            raise DataError("--shard-size must be positive")
        check_folders(args.src, args.out)
        if is_shard_tree(args.src):
            raise DataError(f"--src {args.src} holds shards already; --src takes an ImageFolder tree")
        counts = write_shards(Path(args.src), Path(args.out), args.shard_size)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the disk filled up, say: write_shards left the old set (if any) as it was
        print(f"error: writing the shards to {args.out} failed ({err}); nothing was changed there", file=sys.stderr)
        return 1
    if counts["unreadable"]:
        print(f"warning: {len(counts['unreadable'])} file(s) could not be read and are stored empty (skipped in "
              f"training, as in the tree), e.g. {', '.join(counts['unreadable'][:3])}")
    if counts["empty"]:  # (kept, as the trainer keeps them: the class indices stay the tree's)
        print(f"warning: {len(counts['empty'])} class folder(s) hold no training images and are written as "
              f"classes without samples: {', '.join(counts['empty'][:5])}")
    print(f"wrote {counts['train']} train and {counts['val']} val samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
