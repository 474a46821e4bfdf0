# The cluster image, for V100, A100 and H100 nodes alike: torch 2.14.1 (the torch the test suite
# runs) in its CUDA 12.6 build from PyTorch's index, the one with V100 kernels (sm_70), on NGC
# PyTorch's CUDA 12.6 toolkit, NCCL and Open MPI; DALI for CUDA 12; Horovod built with NCCL + MPI +
# gloo for compute capabilities 7.0, 8.0 and 9.0; this project, and its tests so that the GPU check
# runs in the image. Nothing of the test suite's own cluster (Slurm, munge, an sshd): the cluster
# the image runs on brings its own. Every install step is the script the README's set-up runs
# (scripts/setup.sh, which builds Horovod with scripts/install_horovod.sh); only its settings differ.
#   docker build -t resnet-trainer .
#   docker run --gpus all --ipc=host -v "$PWD/gpu_figures:/opt/resnet-trainer/gpu_figures" resnet-trainer \
#       bash scripts/gpu_check.sh
#   docker run --gpus all --ipc=host -v /data/imagenet:/data resnet-trainer \
#       horovodrun -np 8 python -m train --data-dir /data --preset mlperf-bs3264
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3
FROM ${BASE_IMAGE}

# VENV=none: into the image's own python, whose torch the pinned one replaces. An image build sees
# no GPU: TRAINER_GPUS names the ones the image is for, and the set-up picks the builds from it
# (torch's CUDA 12.6 build and DALI for CUDA 12, for the V100; Horovod with NCCL, compiled for
# HOROVOD_BUILD_CUDA_CC_LIST=70,80,90). PIP_CONSTRAINT is emptied because newer NGC images pin
# their own torch with it.
ENV VENV=none \
    PYTHON=python \
    TORCH=pinned \
    TRAINER_GPUS=7.0,8.0,9.0 \
    HOROVOD_WITH_MPI=1 \
    PIP_CONSTRAINT= \
    TRAINER_CACHE_DIR=/var/cache/resnet-trainer

WORKDIR /opt/resnet-trainer
COPY pyproject.toml README.md ./
COPY models ./models
COPY data ./data
COPY train ./train
COPY scripts ./scripts
COPY tests ./tests
RUN bash scripts/setup.sh

CMD ["python", "-m", "train"]
