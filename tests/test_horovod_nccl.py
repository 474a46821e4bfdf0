"""A GPU run under a Horovod built without NCCL says so at start: its gradient all-reduces then go
through host memory. Checked with the Horovod installed here (a gloo/MPI build: nccl_built() is false)
and the engine's "this rank has a GPU" decision faked, as a CPU machine cannot make it."""
import json
import subprocess
import sys

import torch

from helpers import REPO, child_env
from train.engines.horovod import nccl_warning

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")

# start-up with the real Horovod (one rank) on a faked GPU; the rest of set-up on this CPU
ONE_RANK_ON_A_FAKED_GPU = """
import json, torch
from train.cli import parse
from train.engines import horovod as horovod_engine
from train.startup import checked_setup
horovod_engine.local_device = lambda local_rank: torch.device("cuda", 0)
cfg = parse(["--engine", "horovod", "--arch", "resnet18", "--loader", "synthetic", "--synthetic-images", "64",
             "--image-size", "32", "--global-batch-size", "32"])
engine = horovod_engine.Horovod(cfg)
engine.device = torch.device("cpu")
run, loader, precision, *_, warnings = checked_setup(cfg, engine, "")
loader.close()
engine.shutdown()
print(json.dumps({"nccl_built": bool(engine.hvd.nccl_built()), "warnings": warnings}))
"""


def test_horovod_without_nccl_is_one_warning_line_on_a_gpu_and_nothing_on_a_cpu():
    import horovod.torch as hvd
    assert not hvd.nccl_built()  # the build installed here
    line = nccl_warning(hvd.nccl_built(), GPU)
    assert line.startswith("Horovod was built without NCCL") and "host memory" in line and "\n" not in line
    assert "scripts/setup.sh" in line and "TRAINER_GPUS" in line
    assert nccl_warning(hvd.nccl_built(), CPU) == ""  # gloo or MPI is the CPU's own all-reduce
    assert nccl_warning(1, GPU) == ""  # (Horovod answers the NCCL version's number, or 0)


def test_the_horovod_engine_puts_the_line_with_the_runs_warnings():
    done = subprocess.run([sys.executable, "-c", ONE_RANK_ON_A_FAKED_GPU], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=child_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["nccl_built"] is False
    assert [line for line in result["warnings"] if line.startswith("Horovod was built without NCCL")] == \
        [nccl_warning(False, GPU)]
