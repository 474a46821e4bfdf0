"""Encoded image bytes to RGB pixels, for the torch loader.

A training crop needs only its region of the image. nvImageCodec's CPU decoder (libjpeg-turbo; it is
installed with DALI) decodes a region of a JPEG without the colour work outside it and without the
rows below it, so on ImageNet-like JPEGs a random-resized crop costs less than the whole image
(scripts/bench/loader.py). PIL takes everything else (PNG, truncated files, machines without
nvImageCodec, anything nvImageCodec refuses) and is the one that decides a file is unreadable.
"""
import io
import threading

import numpy as np
import torch
from PIL import Image

from data.sources import complete_jpeg

class BadImage(Exception):
    """A file that is no readable image (zero bytes, truncated, not an image at all)."""


def load_rgb(path, name: str | None = None) -> Image.Image:
    """Any image PIL can read (JPEG, a PNG under a .JPEG name, CMYK, grayscale, palette) as RGB.
    `path` is a file name or a file object (a shard member's bytes)."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise BadImage(f"{name or path} ({type(err).__name__})") from err


_local = threading.local()  # a decoder must not be shared between threads


def _nvimgcodec():
    """This thread's (module, decoder, params), or False where nvImageCodec is missing or fails.
    One CPU thread each: the loader's threads are the parallelism."""
    if not hasattr(_local, "codec"):
        try:
            from nvidia import nvimgcodec
            decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                         backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
            # as PIL reads them: EXIF orientation is not applied, so regions mean the same pixels
            params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                             sample_format=nvimgcodec.SampleFormat.I_RGB)
            _local.codec = (nvimgcodec, decoder, params)
        except (ImportError, OSError, RuntimeError):  # not installed, or its libraries do not load here
            _local.codec = False
    return _local.codec


class Encoded:
    """One image's bytes: its size (from the header when it can), then the pixels of any region
    as an (H, W, 3) uint8 tensor."""

    def __init__(self, payload: bytes, name: str):
        self.payload, self.name = payload, name
        self.stream, self.pixels = None, None
        codec = _nvimgcodec() if complete_jpeg(payload) else None
        if codec:
            try:
                self.stream = codec[0].CodeStream(payload)
            except RuntimeError:  # a header it cannot parse
                pass
        if self.stream is not None:
            self.height, self.width = self.stream.height, self.stream.width
        else:
            self._decode_with_pil()

    def _decode_with_pil(self) -> None:
        self.pixels = torch.from_numpy(np.array(load_rgb(io.BytesIO(self.payload), self.name)))
        self.height, self.width = self.pixels.shape[:2]

    def region(self, top: int = 0, left: int = 0, height: int | None = None, width: int | None = None) -> torch.Tensor:
        height, width = height or self.height, width or self.width
        if self.pixels is None:
            module, decoder, params = _nvimgcodec()
            stream = self.stream if (height, width) == (self.height, self.width) else \
                self.stream.get_sub_code_stream(region=module.Region(top, left, top + height, left + width))
            image = decoder.decode(stream, params=params)
            if image is not None:
                return torch.from_numpy(np.asarray(image.cpu()))
            self._decode_with_pil()  # refused: PIL decodes it or says it is unreadable
        return self.pixels[top:top + height, left:left + width]
