"""`--loader dali`: NVIDIA DALI decodes and augments; on a GPU with device='mixed' (nvJPEG, the
hardware JPEG decoder where the GPU has one, ROI decoding of the random crop), on a CPU-only
machine the same pipeline with CPU operators (device_id=None).

Which files each rank reads, and in which order, comes from the same sampler as the torch loader
(data/sharding.py): the pipeline's external source hands DALI the encoded bytes of exactly this
rank's slice of each global batch. Batches come out normalised, channels_last, on the device.
Augmentation randomness is DALI's own (seeded per rank and epoch), so bit-exact resume is a
property of the torch loader only.
"""

import numpy as np
import torch

from data.decode import complete_jpeg, complete_png
from data.loaders import EVAL_CROP_FRACTION, IMAGENET_MEAN, IMAGENET_STD, DataError, FileLoader, first_readable
from data.sharding import epoch_seed


def _encoded(source, index: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(the file's bytes, its label) as DALI takes them, or None when DALI could not decode the file:
    empty, unreadable, not JPEG or PNG, or truncated (a DALI decoder error would stop the whole
    pipeline, so files are checked first)."""
    try:
        payload, label = source.read(index)
    except OSError:
        return None
    if not (complete_jpeg(payload) or complete_png(payload)):
        return None
    return np.frombuffer(payload, dtype=np.uint8), np.array(label, dtype=np.int64)


class DaliLoader(FileLoader):
    def __init__(self, cfg, classes, rank, world_size, device):
        try:
            from nvidia.dali import fn, pipeline_def, types
        except ImportError as err:
            raise DataError(f"--loader dali needs NVIDIA DALI ({err}); run scripts/setup.sh or use --loader torch")
        super().__init__(cfg, classes, rank, world_size)
        self.fn, self.types, self.device, self.cfg, self.rank = fn, types, device, cfg, rank
        gpu = device.type == "cuda"
        self.pipeline_kwargs = dict(num_threads=max(1, cfg.workers), device_id=device.index if gpu else None,
                                    prefetch_queue_depth=1)
        self.decode_device = "mixed" if gpu else "cpu"
        # batches in the training precision where DALI has it: fp16 (V100s); DALI has no bf16, so
        # bf16 and fp32 runs get fp32 and autocast casts at the first convolution
        self.half = gpu and cfg.precision == "fp16"
        self.out_type = types.FLOAT16 if self.half else types.FLOAT
        self.pipeline_def = pipeline_def

    # the two pipelines -------------------------------------------------------------------------
    def _train_pipeline(self, feed, seed):
        fn, types, cfg = self.fn, self.types, self.cfg

        @self.pipeline_def(batch_size=self.sampler.batch_size, seed=seed, **self.pipeline_kwargs)
        def train():
            jpegs, labels = fn.external_source(source=feed, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
            images = fn.decoders.image_random_crop(jpegs, device=self.decode_device, output_type=types.RGB,
                                                   random_area=[cfg.crop_min_scale, cfg.crop_max_scale],
                                                   random_aspect_ratio=[cfg.crop_min_aspect, cfg.crop_max_aspect],
                                                   num_attempts=100)
            images = fn.resize(images, resize_x=cfg.image_size, resize_y=cfg.image_size, antialias=True)
            return self._normalise(images, mirror=fn.random.coin_flip()), labels
        return train()

    def _eval_pipeline(self, feed, batch_size):
        fn, types, cfg = self.fn, self.types, self.cfg

        @self.pipeline_def(batch_size=batch_size, seed=0, **self.pipeline_kwargs)
        def evaluate():
            jpegs, labels = fn.external_source(source=feed, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
            images = fn.decoders.image(jpegs, device=self.decode_device, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=round(cfg.image_size / EVAL_CROP_FRACTION), antialias=True)
            return self._normalise(images, crop=(cfg.image_size, cfg.image_size)), labels
        return evaluate()

    def _normalise(self, images, **crop_or_mirror):
        """(x - mean) / std in the batch's type, HWC; with a centre crop or a random mirror."""
        return self.fn.crop_mirror_normalize(images, dtype=self.out_type, output_layout="HWC",
                                            mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
                                            **crop_or_mirror)

    # feeding: this rank's files, bad ones skipped and counted --------------------------------------
    def _train_feed(self, batches):
        counted = set()  # this epoch's unreadable files, each counted once
        for batch in batches:
            payloads, labels = [], []
            for index, _ in batch:  # as the torch loader: the next readable file takes a bad one's place
                (payload, label), skipped = first_readable(self.train_source, index,
                                                           lambda position: _encoded(self.train_source, position))
                self._note_skipped(skipped, counted)
                payloads.append(payload)
                labels.append(label)
            yield payloads, labels

    def _run(self, pipe):
        """Batches until the feed runs out (DALI passes the feed's StopIteration on from run())."""
        pipe.build()
        while True:
            try:
                images, labels = pipe.run()
            except StopIteration:
                return
            images = torch.as_tensor(np.asarray(images.as_cpu().as_tensor())) if self.device.type == "cpu" else \
                _dali_to_torch(images.as_tensor(), self.device, torch.float16 if self.half else torch.float32)
            labels = torch.as_tensor(np.asarray(labels.as_cpu().as_tensor())).reshape(-1).to(self.device)
            # DALI gives NHWC; as NCHW with channels_last strides this is the layout the model wants
            yield images.permute(0, 3, 1, 2), labels

    def train_batches(self, epoch, start_step=0, augment=True):
        self.sampler.epoch, self.sampler.start_step = epoch, start_step
        feed = self._train_feed(iter(self.sampler))
        if not augment:  # the evaluation transform on the training files
            return self._run(self._eval_pipeline(lambda: next(feed), self.sampler.batch_size))
        seed = (epoch_seed(self.cfg.seed, epoch) * 1009 + self.rank) % (1 << 31)  # DALI's own per rank and epoch
        return self._run(self._train_pipeline(lambda: next(feed), seed))

    def _eval_feed(self):
        counted = set()
        for batch in self.eval_batches:
            payloads, labels = [], []
            for index in batch:
                sample = _encoded(self.val_source, index)
                if sample is None:  # counted, not evaluated
                    self._note_skipped([self.val_source.name(index)], counted)
                    continue
                payloads.append(sample[0])
                labels.append(sample[1])
            if payloads:
                yield payloads, labels

    def val_batches(self):
        feed = self._eval_feed()
        return self._run(self._eval_pipeline(lambda: next(feed), self.cfg.batch_size))


def _dali_to_torch(tensor, device, dtype):
    from nvidia.dali.plugin.pytorch import feed_ndarray
    out = torch.empty(tensor.shape(), dtype=dtype, device=device)
    feed_ndarray(tensor, out, cuda_stream=torch.cuda.current_stream(device))
    return out
