"""How bytes become batches.

Every loader hands the training loop the same thing: (images, labels) already on the device,
normalised float, channels_last when asked, sharded by global rank, and in an order fixed by
(seed, epoch) so that a resumed run sees exactly the batches an uninterrupted one would.
"""
from data.loaders import DataError, Loader, build_loader

__all__ = ["DataError", "Loader", "build_loader"]
