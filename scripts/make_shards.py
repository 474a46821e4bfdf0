"""Write tar shards (webdataset layout, DALI index per shard) from an ImageFolder tree.

    python scripts/make_shards.py --src DATA_DIR --out SHARD_DIR [--shard-size 1000]

DATA_DIR holds train/<class>/* and val/<class>/*; SHARD_DIR gets train/shard-NNNNNN.{tar,idx},
val/..., and classes.txt. `python -m train --data-dir SHARD_DIR` reads them.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.loaders import DataError, check_tree  # noqa: E402
from data.shards import write_shards  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    args = parser.parse_args()
    try:
        check_tree(args.src)
        if args.shard_size <= 0:
            raise DataError("--shard-size must be positive")
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    counts = write_shards(Path(args.src), Path(args.out), args.shard_size)
    print(f"wrote {counts['train']} train and {counts['val']} val samples to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
