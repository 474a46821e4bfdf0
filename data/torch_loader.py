"""`--loader torch`: ImageFolder trees or tar shards, decoded and augmented by `--workers` threads that
write straight into each batch's memory.

Threads, not DataLoader processes: decoding (only the crop's region, data/decode.py), resizing and
normalising all run in C with the GIL released, so threads run in parallel, and a batch needs no copy
between processes (scripts/bench/loader.py measures both). On a GPU the batch is pinned uint8 NHWC,
a quarter of the bytes to move, normalised on the device; on a CPU the threads normalise it too.

Each sample's augmentation comes from its own seed (data/sharding.py), so batches do not depend on
the number of threads or their timing, and a resumed run repeats an uninterrupted one bit for bit.
An unreadable file is skipped and counted (once per epoch, however many searches pass it), and the
next readable file (with its own label) takes its place, so every rank's batch keeps its size and no
label shifts.
"""
import ctypes
import math
import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch
from torchvision.transforms.v2 import functional as TF

from data.decode import BadImage, Encoded
from data.loaders import IMAGENET_MEAN, IMAGENET_STD, FileLoader, eval_geometry, eval_size
from data.sources import first_readable
from data.transfer import to_device

BATCHES_IN_FLIGHT = 2  # the batch being consumed plus one being filled


def crop_box(height: int, width: int, scale, ratio, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random-resized crop: torchvision's rule (area fraction from
    `scale`, log-uniform aspect ratio from `ratio`, ten tries, then the whole image clamped to `ratio`)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TrainCrop:
    """Random-resized crop + horizontal flip of an Encoded image, decoding only the crop: (3, size, size) uint8."""

    def __init__(self, size: int, scale: tuple[float, float], ratio: tuple[float, float]):
        self.size, self.scale, self.ratio = size, scale, ratio

    def __call__(self, image: Encoded, seed: int) -> torch.Tensor:
        rng = random.Random(seed)
        top, left, height, width = crop_box(image.height, image.width, self.scale, self.ratio, rng)
        crop = image.region(top, left, height, width).permute(2, 0, 1)
        crop = torch.nn.functional.interpolate(crop[None], size=(self.size, self.size), mode="bilinear",
                                               antialias=True)[0]
        return crop.flip(-1) if rng.random() < 0.5 else crop


class EvalCrop:
    """Resize the shorter side to size/0.875, then centre crop: (3, size, size) uint8."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image: Encoded, seed=None) -> torch.Tensor:
        height, width, top, left = eval_geometry(image.height, image.width, self.size)
        pixels = TF.resize(image.region().permute(2, 0, 1), [height, width], antialias=True)
        return pixels[:, top:top + self.size, left:left + self.size]


class BatchMaker:
    """Batches of crops, normalised with the ImageNet mean and std ((x / 255 - mean) / std) as the
    model takes them: `empty(n)`, `put` each crop (uint8 (3, size, size)) in its slot (from any
    thread), then `on_device`. The loader's batches, and train/inference.py's (predict, export's
    check)."""

    def __init__(self, size: int, device: torch.device, channels_last: bool):
        self.size, self.device = size, device
        self.layout = torch.channels_last if channels_last else torch.contiguous_format
        # (x - mean) / std as x * scale + shift, both whole channels_last images: a 3-vector broadcast
        # along channels_last's innermost dimension does not vectorise on a CPU (3x slower there)
        scale = 1 / (torch.tensor(IMAGENET_STD) * 255)
        shift = -torch.tensor(IMAGENET_MEAN) * 255 * scale
        whole = (v.view(1, 3, 1, 1).expand(1, 3, size, size).contiguous(memory_format=torch.channels_last)
                 for v in (scale, shift))
        self.scale, self.shift = (to_device(v, device) for v in whole)

    def empty(self, n: int) -> torch.Tensor:
        """NCHW: on a GPU a view of pinned NHWC uint8, on a CPU the normalised float batch itself."""
        if self.device.type == "cuda":
            return torch.empty(n, self.size, self.size, 3, dtype=torch.uint8, pin_memory=True).permute(0, 3, 1, 2)
        return torch.empty(n, 3, self.size, self.size, memory_format=self.layout)

    def put(self, batch: torch.Tensor, slot: int, pixels: torch.Tensor) -> None:
        if batch.dtype == torch.uint8:
            batch[slot].copy_(pixels)
        else:
            torch.addcmul(self.shift[0], pixels, self.scale[0], out=batch[slot])

    def on_device(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.dtype == torch.uint8:  # a GPU run's pinned batch: normalised there
            batch = to_device(batch, self.device).float().mul_(self.scale).add_(self.shift)
        return batch.contiguous(memory_format=self.layout)  # a copy only for a batch that lost a skipped image


def decoded(source, index: int, crop, seed=None) -> tuple[torch.Tensor, int]:
    """(crop of the image, label), or BadImage when the file cannot be read or decoded."""
    try:
        payload, label = source.read(index)
    except OSError as err:
        raise BadImage(f"{source.name(index)} ({type(err).__name__})") from err
    return crop(Encoded(payload, source.name(index)), seed), label


def train_item(source, index: int, seed: int, crop) -> tuple[torch.Tensor, int, list[str]]:
    """The crop and label of the first readable file from `index` on, and the files skipped."""
    def attempt(position):
        try:
            return decoded(source, position, crop, seed)
        except BadImage:
            return None
    (pixels, label), skipped = first_readable(source, index, attempt)
    return pixels, label, skipped


def _one_intra_op_thread() -> None:
    """Keep each worker thread's torch ops on that thread: an OpenMP team per worker would
    oversubscribe the cores. OpenMP's thread count is per thread, so the main thread keeps its own;
    torch.set_num_threads would change it for the whole process."""
    torch.get_num_threads()  # torch sets this thread's OpenMP count on first use; set ours after it
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except AttributeError:  # a torch built without OpenMP
        pass


class TorchLoader(FileLoader):
    def __init__(self, cfg, classes, rank, world_size, device):
        super().__init__(cfg, classes, rank, world_size)
        self.cfg, self.device, self.channels_last = cfg, device, cfg.channels_last
        self.eval_crop = EvalCrop(eval_size(cfg))
        self.eval_maker = BatchMaker(eval_size(cfg), device, cfg.channels_last)
        self.set_image_size(cfg.image_size)
        self.pool = ThreadPoolExecutor(max(1, cfg.workers), thread_name_prefix="loader",
                                       initializer=_one_intra_op_thread)

    def set_image_size(self, size: int) -> None:
        """The training crops (and their batches) at `size` px: the random-resized crop, and the
        evaluation transform for epochs without augmentation (--augment-off-epoch)."""
        super().set_image_size(size)
        cfg = self.cfg
        self.train_crop = TrainCrop(size, (cfg.crop_min_scale, cfg.crop_max_scale), (cfg.crop_min_aspect, cfg.crop_max_aspect))
        self.plain_crop = EvalCrop(size)
        self.train_maker = self.eval_maker if size == self.eval_maker.size else BatchMaker(size, self.device, self.channels_last)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    # a batch: empty memory (the maker's, of its crop size), filled slot by slot by the threads, then
    # handed to the loop --------------------------------------------------------------------------
    def _train_slot(self, batch, slot, key, crop):
        pixels, label, skipped = train_item(self.train_source, *key, crop)
        self.train_maker.put(batch, slot, pixels)
        return label, skipped

    def _eval_slot(self, batch, slot, index):
        try:
            pixels, label = decoded(self.val_source, index, self.eval_crop)
        except BadImage:  # counted, not evaluated
            return None, [self.val_source.name(index)]
        self.eval_maker.put(batch, slot, pixels)
        return label, []

    def _batches(self, keys_per_batch, fill_slot, maker: BatchMaker):
        """Device batches in order, with BATCHES_IN_FLIGHT of them being filled by the threads."""
        def start(keys):
            batch = maker.empty(len(keys))
            return batch, [self.pool.submit(fill_slot, batch, slot, key) for slot, key in enumerate(keys)]

        keys_per_batch = iter(keys_per_batch)
        counted = set()  # this pass's unreadable files, each counted once
        in_flight = deque(start(keys) for _, keys in zip(range(BATCHES_IN_FLIGHT), keys_per_batch))
        try:
            while in_flight:
                batch, slots = in_flight.popleft()
                following = next(keys_per_batch, None)
                if following is not None:
                    in_flight.append(start(following))
                labels, skipped = zip(*(slot.result() for slot in slots))
                self._note_skipped([name for names in skipped for name in names], counted)
                good = [i for i, label in enumerate(labels) if label is not None]
                if not good:
                    continue
                if len(good) < len(labels):
                    batch = batch[good]
                yield maker.on_device(batch), to_device(torch.tensor([labels[i] for i in good]), self.device)
        finally:  # the loop stopped early: drop the work queued for batches nobody will read
            for _, slots in in_flight:
                for slot in slots:
                    slot.cancel()

    def train_batches(self, epoch, start_step=0, augment=True):
        self.sampler.epoch, self.sampler.start_step = epoch, start_step
        crop = self.train_crop if augment else self.plain_crop  # without augmentation: the evaluation transform
        positions = deque()  # of the batches handed to the threads, in order

        def keys():
            for where, batch in self.sampler.batches():
                positions.append(where)
                yield batch
        for batch in self._batches(keys(), lambda batch, slot, key: self._train_slot(batch, slot, key, crop),
                                   self.train_maker):
            self.last_positions = positions.popleft()
            yield batch

    def val_batches(self):
        return self._batches(self.eval_batches, self._eval_slot, self.eval_maker)
