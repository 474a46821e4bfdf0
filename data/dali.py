"""`--loader dali`: NVIDIA DALI decodes and augments; on a GPU with device='mixed' (nvJPEG, the
hardware JPEG decoder where the GPU has one, ROI decoding of the random crop), on a CPU-only
machine the same pipeline with CPU operators (device_id=None).

Which files each rank reads, and in which order, comes from the same sampler as the torch loader
(data/sharding.py). Training files are read and checked off the training thread: a parallel external
source runs `TrainReader` (data/dali_reader.py, no torch) in DALI's reader processes (`--workers` of
them, started with 'spawn'), a batch per call; each call takes its files from the pass it belongs to
(this rank's order for the epoch and the first step, which the main process writes into a small
shared record before the pass) and the batch's place in it. The pipelines are built once per run
(again only when batch-size control changes the per-rank batch) and keep BATCHES_AHEAD batches under
way. The crop size is an input of the graph, not a constant of it: each sample's meta carries the
pass's (data/dali_reader.py), so progressive resizing neither rebuilds a pipeline nor respawns its
readers. Evaluation files (50,000 against the training split's 1.28 million, and not every epoch) are
read by `--workers` threads of the main process ahead of the evaluation pipeline (also built once),
so no second set of reader processes is kept for them, and the main thread only hands them over.

Batches come out normalised, on the device, in the run's precision: fp16 and fp32 as DALI writes
them, seen by torch through DLPack without a copy; bf16 as one cast of DALI's fp16 (DALI has no
bf16). They are channels_last when the run asks for it, else NCHW; their labels reach the device
through data/transfer.py's `to_device`. On a GPU the hardware JPEG decoder's share and DALI's threads
are set for MLPerf's rate (docs/gpu.md, "DALI on a GPU").

Augmentation randomness is DALI's own, seeded per rank and by the first epoch the run trains, so
bit-exact resume is a property of the torch loader only. Since the readers are spawned processes, a
script that builds this loader needs the `if __name__ == "__main__":` guard (python -m train has it).
A reader ends by itself once the process that built the pipeline has (TrainReader watches for it), so
a trainer killed with SIGKILL leaves none.
"""
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from data.dali_reader import CROP, FILE, LABEL, SHORT, SKIPPED, STEP, PassRecord, TrainReader, encoded, packed
from data.loaders import EVAL_CROP_FRACTION, IMAGENET_MEAN, IMAGENET_STD, DataError, FileLoader, eval_size
from data.sharding import epoch_permutation, epoch_seed
from data.transfer import to_device

BATCHES_AHEAD = 2  # decoded batches DALI keeps ready, and batches of files its readers keep ready
_BYTES_PER_SAMPLE = 1 << 17  # ImageNet's JPEGs average about 110 KB; DALI grows its buffers past it
# nvJPEG on a GPU ('mixed'): the share of the JPEGs given to the GPU's hardware JPEG decoder (A100,
# H100, H200; ignored where there is none, as on V100), and DALI's CPU threads per GPU, which parse
# every file and Huffman-decode what the hardware decoder does not take: NVIDIA's MLPerf ResNet-50
# settings on DGX A100 and H100, whose H200 rate is about 7,950 images/s (docs/gpu.md, "DALI on a GPU").
HW_DECODER_LOAD = 0.99
GPU_DECODE_THREADS = 6


def crop_sides(size: int) -> tuple[int, int]:
    """(crop side, the evaluation transform's shorter side before its centre crop) for crops of `size`
    px: what each sample's meta tells the pipeline (data/dali_reader.py's CROP and SHORT)."""
    return size, round(size / EVAL_CROP_FRACTION)


# the main process's side of a pipeline ------------------------------------------------------------
class _Passes:
    """A pipeline built once and run pass after pass: DALI ends a pass when its source raises
    StopIteration, and reset() readies the next. A pass left unfinished (the loop stopped early) is
    closed when the next begins: its source is told to stop and the batches under way are drained."""

    def __init__(self, pipe, stop_source, device=torch.device("cpu")):
        self.pipe, self.stop_source, self.device, self.count, self.current = pipe, stop_source, device, 0, None
        pipe.build()

    def begin(self) -> object:
        """Close an unfinished pass; a token for the pass now beginning (the count is DALI's epoch index)."""
        if self.current is not None:
            self.stop_source()
            for _ in self.outputs(self.current):
                pass
        self.current = object()
        return self.current

    def outputs(self, token):
        """The pipeline's outputs until the pass ends; nothing once a newer pass has begun."""
        while self.current is token:
            # on a GPU the outputs are ordered on torch's current stream (it waits for DALI's work
            # there), so the host does not wait for them
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            try:
                outputs = self.pipe.run(stream)
            except StopIteration:
                self.pipe.reset()
                self.count, self.current = self.count + 1, None
                return
            except Exception as err:  # a reader's DataError (no readable file at all), as the loop expects it
                last, raised = str(err).strip().rpartition("\n")[2], f"{DataError.__module__}.{DataError.__name__}: "
                if last.startswith(raised):
                    raise DataError(last[len(raised):]) from err
                raise
            yield outputs


class _Pull:
    """A main-thread batch source: the next batch of the current pass's feed."""

    def __init__(self):
        self.feed = iter(())

    def __call__(self):
        return next(self.feed)

    def stop(self) -> None:
        close = getattr(self.feed, "close", None)
        if close is not None:  # its reads under way are dropped
            close()
        self.feed = iter(())


def _parallel_source(fn, types, reader: TrainReader, workers: int):
    """(encoded bytes, meta) from `reader` in DALI's reader processes: a whole batch per call, so the
    main process takes meta as one array; enough batches under way to keep every reader busy."""
    return fn.external_source(source=reader, num_outputs=2, dtype=[types.UINT8, types.INT64], parallel=True,
                              batch=True, batch_info=True, prefetch_queue_depth=max(BATCHES_AHEAD, workers),
                              bytes_per_sample_hint=_BYTES_PER_SAMPLE)


class DaliLoader(FileLoader):
    def __init__(self, cfg, classes, rank, world_size, device):
        try:
            from nvidia.dali import fn, math as dali_math, pipeline_def, types
        except ImportError as err:
            raise DataError(f"--loader dali needs NVIDIA DALI ({err}); run scripts/setup.sh or use --loader torch")
        super().__init__(cfg, classes, rank, world_size)
        self.fn, self.types, self.dali_math, self.device, self.cfg, self.rank = fn, types, dali_math, device, cfg, rank
        gpu = device.type == "cuda"
        # --dali-decode: on a GPU nvJPEG decodes ('mixed') unless the CPU is asked to; then the decoded,
        # cropped and resized images go to the GPU, where they are normalised
        self.decode_device = "mixed" if gpu and cfg.dali_decode != "cpu" else "cpu"
        self.to_gpu = gpu and self.decode_device == "cpu"
        # DALI's CPU threads: decoding on the CPU, --workers of them; feeding nvJPEG, at least
        # GPU_DECODE_THREADS (--workers' default, 4, is below what NVIDIA's MLPerf runs give each GPU)
        threads = max(GPU_DECODE_THREADS, cfg.workers) if self.decode_device == "mixed" else max(1, cfg.workers)
        # exec_dynamic: the batches are DALI's own buffers seen through DLPack, and the dynamic executor keeps
        # a buffer for as long as torch holds it (the static one reuses it a few runs later)
        self.pipeline_kwargs = dict(num_threads=threads, device_id=device.index if gpu else None,
                                    prefetch_queue_depth=BATCHES_AHEAD, exec_dynamic=True)
        # batches in the run's precision: fp16 and fp32 as DALI writes them; DALI has no bf16, so a
        # bf16 run casts DALI's fp16 once on the device, rather than autocast casting fp32: DALI writes
        # half the bytes and the cast reads half (docs/gpu.md, "DALI on a GPU")
        self.precision = cfg.precision
        self.out_type = types.FLOAT16 if cfg.precision in ("fp16", "bf16") else types.FLOAT
        self.layout = "HWC" if cfg.channels_last else "CHW"  # NHWC is NCHW in channels_last strides
        self.pipeline_def = pipeline_def
        self.builds = 0  # pipelines built (once per run and kind, again when the per-rank batch changes)
        self.passes = {}  # augment (True | False) -> ((per-rank batch, batches per step), _Passes, PassRecord) of the training pipelines
        self.val_passes, self.val_pull = None, _Pull()
        # the evaluation files' readers: threads, which wait on the disk with the GIL released
        self.eval_readers = ThreadPoolExecutor(max(1, cfg.workers), thread_name_prefix="dali-eval-reader")
        self.eval_read_ahead = max(1, cfg.workers) + BATCHES_AHEAD  # batches read or being read
        self.reader_source = None  # the training split as the reader processes get it, packed once

    # the pipelines -----------------------------------------------------------------------------
    def _pipeline(self, source, batch_size, seed, augment, parallel=False):
        """The graph on (encoded bytes, meta) from `source`: with `augment` a random-resized crop and
        flip, else the evaluation transform (resize and centre crop), to the size each sample's meta
        carries. Outputs (images, meta)."""
        fn, types = self.fn, self.types
        readers = dict(py_num_workers=max(1, self.cfg.workers), py_start_method="spawn") if parallel else {}

        @self.pipeline_def(batch_size=batch_size, seed=seed, **self.pipeline_kwargs, **readers)
        def pipeline():
            jpegs, meta = _parallel_source(fn, types, source, self.cfg.workers) if parallel else \
                fn.external_source(source=source, num_outputs=2, dtype=[types.UINT8, types.INT64], batch=True)
            crop, short = meta[CROP], meta[SHORT]
            return (self._train_transform(jpegs, crop) if augment else self._eval_transform(jpegs, crop, short)), meta
        self.builds += 1
        return pipeline()

    def _train_transform(self, jpegs, crop):
        fn, types, cfg = self.fn, self.types, self.cfg
        hardware = dict(hw_decoder_load=HW_DECODER_LOAD) if self.decode_device == "mixed" else {}
        # no EXIF rotation: the torch loader (and PIL) read the pixels as stored
        images = fn.decoders.image_random_crop(jpegs, device=self.decode_device, output_type=types.RGB,
                                               adjust_orientation=False, random_area=[cfg.crop_min_scale, cfg.crop_max_scale],
                                               random_aspect_ratio=[cfg.crop_min_aspect, cfg.crop_max_aspect],
                                               num_attempts=100, **hardware)
        side = fn.cast(crop, dtype=types.FLOAT)
        images = fn.resize(images, resize_x=side, resize_y=side, antialias=True)
        return self._normalise(images.gpu() if self.to_gpu else images, mirror=fn.random.coin_flip())

    def _eval_transform(self, jpegs, crop, short):
        """The torch loader's evaluation transform, box for box (data/loaders.py eval_geometry): DALI's
        own resize_shorter rounds the longer side where torchvision truncates it, and its centre crop
        rounds half a margin up where torchvision rounds it to even, each shifting the crop by half a
        pixel or one. Decoded as the torch loader decodes (no EXIF rotation, libjpeg-turbo's chroma
        upsampling also on the GPU)."""
        fn, types = self.fn, self.types
        images = fn.decoders.image(jpegs, device=self.decode_device, output_type=types.RGB, adjust_orientation=False,
                                   jpeg_fancy_upsampling=True)
        height, width, top, left = self._eval_geometry(jpegs, crop, short)
        images = fn.resize(images, resize_y=fn.cast(height, dtype=types.FLOAT), resize_x=fn.cast(width, dtype=types.FLOAT),
                           antialias=True)
        images = images.gpu() if self.to_gpu else images
        side = fn.cast(crop, dtype=types.FLOAT)
        # the crop's corner as the fraction of the margin DALI takes; it rounds that back to the same pixel
        return self._normalise(images, crop_h=side, crop_w=side, crop_pos_y=top / self.dali_math.max(height - crop, 1),
                               crop_pos_x=left / self.dali_math.max(width - crop, 1))

    def _eval_geometry(self, jpegs, crop, short):
        """eval_geometry in DALI's arithmetic, per sample from the encoded image's header, for crops of
        `crop` px after resizing the shorter side to `short` (crop_sides; per-sample values or numbers)."""
        shape = self.fn.peek_image_shape(jpegs, adjust_orientation=False)
        height, width = shape[0], shape[1]
        shorter = self.dali_math.min(height, width)
        height, width = short * height // shorter, short * width // shorter

        def corner(extent):  # half the margin, rounded half to even: (margin + (half % 2)) // 2
            margin = extent - crop
            half = margin // 2
            return (margin + half - half // 2 * 2) // 2
        return height, width, corner(height), corner(width)

    def _normalise(self, images, **crop_or_mirror):
        """(x - mean) / std in the batch's type and layout; with a centre crop or a random mirror."""
        return self.fn.crop_mirror_normalize(images, dtype=self.out_type, output_layout=self.layout,
                                            mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
                                            **crop_or_mirror)

    def _training_passes(self, augment: bool, epoch: int) -> tuple[_Passes, PassRecord]:
        """The training pipeline of this kind for the current per-rank batch, built on first use (the
        crop size is each pass's own: _train_pass)."""
        batch_size, shape = self.sampler.batch_size, (self.sampler.batch_size, self.sampler.accumulation)
        if augment in self.passes and self.passes[augment][0] == shape:
            return self.passes[augment][1:]
        self.passes.pop(augment, None)  # a batch-size change: the old pipeline and its readers go
        if self.reader_source is None:
            self.reader_source = packed(self.train_source)
        record = PassRecord(self.sampler.steps * self.sampler.accumulation, batch_size)
        seed = (epoch_seed(self.cfg.seed, epoch) * 1009 + self.rank) % (1 << 31)  # DALI's own, per rank
        pipe = self._pipeline(TrainReader(self.reader_source, record), batch_size, seed, augment, parallel=True)
        passes = _Passes(pipe, record.stop, self.device)
        record.remove()  # the readers have it mapped now
        self.passes[augment] = (shape, passes, record)
        return passes, record

    # batches -------------------------------------------------------------------------------------
    def _batch(self, images, meta):
        """DALI's outputs as the loop's (images, labels), and meta as an array (data/dali_reader.py's
        columns)."""
        meta = np.asarray(meta.as_tensor())
        labels = to_device(torch.as_tensor(np.ascontiguousarray(meta[:, LABEL])), self.device)
        return self._images(images), labels, meta

    def _images(self, images) -> torch.Tensor:
        """DALI's images as the model's NCHW batch: DALI's own buffer seen through DLPack, no copy (on a
        GPU ordered after DALI's work on torch's current stream), in channels_last strides where DALI
        wrote NHWC; a bf16 run's one cast of DALI's fp16."""
        batch = torch.from_dlpack(images.as_tensor())
        if self.layout == "HWC":
            batch = batch.permute(0, 3, 1, 2)
        return batch.to(torch.bfloat16) if self.precision == "bf16" else batch

    def train_batches(self, epoch, start_step=0, augment=True):
        """This rank's batches of the epoch (augment=False: the evaluation transform on the training
        files). The sampler is set as the torch loader sets it, though only the readers use its order."""
        self.sampler.epoch, self.sampler.start_step = epoch, start_step
        return self._train_pass(epoch, start_step, bool(augment))

    def _rank_order(self, epoch: int) -> np.ndarray:
        """This rank's files of the epoch, steps x batch: its slice of every global batch of the
        epoch's permutation (TrainBatchSampler's order)."""
        sampler = self.sampler
        batches = sampler.steps * sampler.accumulation  # (--accumulation-steps: each step's batches, in order)
        order = epoch_permutation(sampler.num_items, sampler.seed, epoch)[:batches * sampler.global_batch].numpy()
        first = sampler.rank * sampler.batch_size
        return order.reshape(batches, sampler.global_batch)[:, first:first + sampler.batch_size]

    def _train_pass(self, epoch, start_step, augment):
        passes, record = self._training_passes(augment, epoch)
        token = passes.begin()
        record.start(passes.count, self._rank_order(epoch), start_step * self.sampler.accumulation,
                     crop_sides(self.train_size))
        counted = set()  # this epoch's unreadable files, each counted once
        count = len(self.train_source)
        for images, meta in passes.outputs(token):
            images, labels, meta = self._batch(images, meta)
            for index, skipped in meta[meta[:, SKIPPED] > 0][:, [FILE, SKIPPED]].tolist():
                self._note_skipped([self.train_source.name((index + k) % count) for k in range(skipped)], counted)
            self.last_positions = self.sampler.positions(int(meta[0, STEP]))  # the batch the readers served
            yield images, labels

    def _eval_feed(self):
        """This rank's evaluation batches as the pipeline takes them, (encoded files, meta), read by the
        reader threads up to eval_read_ahead batches ahead: the main thread only hands them over."""
        counted = set()  # this evaluation's unreadable files, each counted once
        batches, reading = iter(self.eval_batches), deque()
        try:
            while True:
                while len(reading) < self.eval_read_ahead and (batch := next(batches, None)) is not None:
                    reading.append(self.eval_readers.submit(self._read_eval_batch, batch))
                if not reading:
                    return
                payloads, meta, unreadable = reading.popleft().result()
                self._note_skipped(unreadable, counted)
                if payloads:
                    yield payloads, meta
        finally:  # an evaluation left unfinished: the reads queued for it go
            for future in reading:
                future.cancel()

    def _read_eval_batch(self, batch) -> tuple[list, list, list[str]]:
        """In a reader thread: (encoded files, meta, names of the unreadable files, which are counted,
        not evaluated) of one evaluation batch."""
        payloads, meta, unreadable = [], [], []
        sides = crop_sides(eval_size(self.cfg))
        for index in batch:
            sample = encoded(self.val_source, index)
            if sample is None:
                unreadable.append(self.val_source.name(index))
                continue
            payloads.append(sample[0])
            meta.append(np.array([sample[1], index, 0, 0, *sides], dtype=np.int64))
        return payloads, meta, unreadable

    def val_batches(self):
        if self.val_passes is None:
            self.val_passes = _Passes(self._pipeline(self.val_pull, self.cfg.batch_size, 0, False),
                                      self.val_pull.stop, self.device)
        token = self.val_passes.begin()
        self.val_pull.feed = self._eval_feed()
        for images, meta in self.val_passes.outputs(token):
            yield self._batch(images, meta)[:2]

    def close(self) -> None:
        """The pipelines go, and with them their reader processes and threads."""
        self.val_pull.stop()
        self.passes.clear()
        self.val_passes = None
        self.eval_readers.shutdown(wait=True, cancel_futures=True)
