"""The suite's fixture: a private cache for generated data (tests/helpers holds the shared helpers)."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Generated datasets and FLOP counts go to a per-session folder, never the user's cache."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("TRAINER_CACHE_DIR")
    os.environ["TRAINER_CACHE_DIR"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("TRAINER_CACHE_DIR", None)
    else:
        os.environ["TRAINER_CACHE_DIR"] = old
