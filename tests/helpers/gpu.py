"""What the tests marked `gpu` share: the skip without CUDA, and the skip without DALI, whose reason
scripts/gpu_check.sh reports as `DALI absent` (any other skip fails the check where CUDA is there)."""
import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DALI_ABSENT = "DALI absent"


def require_dali() -> None:
    """Skip with DALI_ABSENT where DALI is not installed; an installed DALI that fails to load fails."""
    try:
        import nvidia.dali  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name not in ("nvidia", "nvidia.dali"):
            raise
        pytest.skip(DALI_ABSENT)
