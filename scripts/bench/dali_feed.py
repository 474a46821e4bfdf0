"""Main-thread CPU time per image of `--loader dali`'s training feed (time.thread_time while consuming
training batches on a CPU), on generated ImageNet-sized JPEGs (about 500x375, ~100 KB; made once into
a temp folder and reused): the previous feed (every file read and checked on the main thread, the
pipeline rebuilt each epoch, one batch prefetched), kept here as `_MainThreadFeed`, against the
loader's parallel external source (reads in DALI's reader processes, the pipeline built once,
BATCHES_AHEAD batches ahead), measured in the same run. The previous feed's per-epoch builds are
printed apart, not counted: a real epoch is thousands of batches. Batch 256 is the trainer's default
per-rank batch; DALI's own main-thread work per batch (run, outputs) weighs more at small batches
(try --batch-size 32). Also prints the wall-clock images/s of both pipelines (decode-bound here) and
what the feed alone sustains: the main thread reading alone, against the reader processes feeding a
pipeline that only passes the bytes on.
Last line: `dali_feed: RATIO (goal >= 4.0)`, the previous time per image over the new one.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data.dali import DaliLoader, _parallel_source, _Passes, crop_sides  # noqa: E402
from data.dali_reader import PassRecord, TrainReader, encoded, packed  # noqa: E402
from data.sources import first_readable  # noqa: E402
from data.sharding import epoch_seed  # noqa: E402
from data.tree import check_tree  # noqa: E402
from loader import make_tree  # noqa: E402  (scripts/bench/loader.py)
from train.config import Config  # noqa: E402


def main_thread_feed(loader, batches):
    """The previous feed: each file read and checked on the main thread, the next readable one taking
    a bad one's place; meta in data/dali_reader.py's columns, as the pipeline reads them."""
    counted, sides = set(), crop_sides(loader.train_size)
    for batch in batches:
        payloads, meta = [], []
        for index, _ in batch:
            (payload, label), skipped = first_readable(loader.train_source, index,
                                                       lambda position: encoded(loader.train_source, position))
            loader._note_skipped(skipped, counted)
            payloads.append(payload)
            meta.append(np.array([label, index, 0, 0, *sides], dtype=np.int64))
        yield payloads, meta


class _MainThreadFeed(DaliLoader):
    """`--loader dali` as it was: main-thread feed, a pipeline per epoch, prefetch_queue_depth=1."""

    def __init__(self, *args):
        super().__init__(*args)
        self.pipeline_kwargs["prefetch_queue_depth"] = 1
        self.build_seconds = 0.0  # main-thread CPU time of the per-epoch builds, left out of the figures

    def train_batches(self, epoch, start_step=0, augment=True):
        self.sampler.epoch, self.sampler.start_step = epoch, start_step
        feed = main_thread_feed(self, iter(self.sampler))
        seed = (epoch_seed(self.cfg.seed, epoch) * 1009 + self.rank) % (1 << 31)
        start = time.thread_time()
        pipe = self._pipeline(lambda: next(feed), self.sampler.batch_size, seed, augment)
        pipe.build()
        self.build_seconds += time.thread_time() - start
        while True:
            try:
                images, meta = pipe.run()
            except StopIteration:
                return
            yield self._batch(images, meta)[:2]


def dataset(images: int) -> Path:
    """The generated tree, reused from an earlier run when complete."""
    root = Path(tempfile.gettempdir()) / f"dali-feed-bench-{images}"
    if not (root / "complete").exists():
        make_tree(root, images)
        (root / "complete").touch()
    return root


def epochs(loader, first: int, count: int, batch: int) -> tuple[float, float]:
    """(main-thread CPU seconds per image, images per wall second) over `count` epochs. The previous
    feed's per-epoch pipeline builds are left out: a real epoch is thousands of batches, not a few."""
    builds = getattr(loader, "build_seconds", 0.0)
    cpu, wall, images = time.thread_time(), time.perf_counter(), 0
    for epoch in range(first, first + count):
        for x, _ in loader.train_batches(epoch):
            images += len(x)
    assert images == count * loader.steps_per_epoch * batch
    cpu = time.thread_time() - cpu - (getattr(loader, "build_seconds", 0.0) - builds)
    return cpu / images, images / (time.perf_counter() - wall)


def feed_alone_today(loader, epochs_: int) -> float:
    start, images = time.perf_counter(), 0
    for epoch in range(epochs_):
        loader.sampler.epoch, loader.sampler.start_step = epoch, 0
        for payloads, _ in main_thread_feed(loader, iter(loader.sampler)):
            images += len(payloads)
    return images / (time.perf_counter() - start)


def feed_alone_readers(loader, workers: int, epochs_: int) -> float:
    """The reader processes feeding a pipeline that passes the bytes straight out (after a warm-up epoch)."""
    from nvidia.dali import fn, pipeline_def, types
    record = PassRecord(loader.steps_per_epoch, loader.sampler.batch_size)
    reader = TrainReader(packed(loader.train_source), record)

    @pipeline_def(batch_size=loader.sampler.batch_size, num_threads=1, device_id=None, prefetch_queue_depth=2,
                  py_num_workers=workers, py_start_method="spawn")
    def bytes_only():
        return tuple(_parallel_source(fn, types, reader, workers))
    passes = _Passes(bytes_only(), record.stop)
    record.remove()
    images = 0
    for epoch in range(epochs_ + 1):
        if epoch == 1:
            start, images = time.perf_counter(), 0
        token = passes.begin()
        record.start(passes.count, loader._rank_order(epoch), 0, crop_sides(loader.train_size))
        for _, meta in passes.outputs(token):
            images += len(meta)
    return images / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = dataset(args.images)
    size_kb = np.mean([p.stat().st_size for p in (root / "train").rglob("*.JPEG")]) / 1024
    cfg = Config(data_dir=str(root), image_size=224, batch_size=args.batch_size, workers=args.workers)
    classes, cpu = check_tree(str(root)), torch.device("cpu")
    loaders = {"previous": _MainThreadFeed(cfg, classes, 0, 1, cpu), "parallel": DaliLoader(cfg, classes, 0, 1, cpu)}
    for loader in loaders.values():  # warm-up: the page cache, the new loader's one build
        epochs(loader, 0, 1, args.batch_size)
    results = {name: [] for name in loaders}
    for repeat in range(args.repeats):
        for name, loader in loaders.items():
            results[name].append(epochs(loader, 1 + repeat * args.epochs, args.epochs, args.batch_size))
    per_image = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    rate = {name: statistics.median(r[1] for r in runs) for name, runs in results.items()}
    assert loaders["parallel"].builds == 1, loaders["parallel"].builds
    alone_today = feed_alone_today(loaders["previous"], args.epochs)
    alone_readers = feed_alone_readers(loaders["parallel"], args.workers, args.epochs)
    print(f"{args.images} JPEGs, about {size_kb:.0f} KB, batch {args.batch_size}, {args.workers} workers, "
          f"median of {args.repeats} x {args.epochs} epochs")
    print(f"main-thread CPU per image: previous {per_image['previous'] * 1e6:7.1f} us   "
          f"parallel {per_image['parallel'] * 1e6:7.1f} us")
    builds = loaders["previous"].build_seconds / (1 + args.repeats * args.epochs)
    print(f"previous feed's pipeline build, each epoch: {builds * 1e3:.1f} ms of main-thread CPU (left out above)")
    print(f"pipeline images/s (wall, decode-bound on this CPU): previous {rate['previous']:.0f}   "
          f"parallel {rate['parallel']:.0f}")
    print(f"feed alone: main thread {alone_today:.0f} samples/s (one core)   "
          f"{args.workers} reader processes {alone_readers:.0f} samples/s")
    print(f"dali_feed: {per_image['previous'] / per_image['parallel']:.2f} (goal >= 4.0)")


if __name__ == "__main__":
    main()
