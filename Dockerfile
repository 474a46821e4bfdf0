# The cluster image: NGC PyTorch on a CUDA 12 stack (still builds for V100, sm_70), DALI for
# CUDA 12, Horovod with NCCL + MPI + gloo, and this project. Every install step is a script that
# CI also runs (scripts/setup.sh, scripts/install_horovod.sh); only their settings differ here.
#   docker build -t resnet-trainer .
#   docker run --gpus all --ipc=host -v /data/imagenet:/data resnet-trainer \
#       horovodrun -np 8 python -m train --data-dir /data --preset mlperf-bs3264
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3
FROM ${BASE_IMAGE}

ENV VENV=none \
    PYTHON=python \
    TORCH=keep \
    DALI_PACKAGE=nvidia-dali-cuda120 \
    HOROVOD_GPU_OPERATIONS=NCCL \
    HOROVOD_WITH_MPI=1 \
    HOROVOD_BUILD_CUDA_CC_LIST=70,80,90 \
    TRAINER_CACHE_DIR=/var/cache/resnet-trainer

WORKDIR /opt/resnet-trainer
COPY pyproject.toml README.md ./
COPY models ./models
COPY data ./data
COPY train ./train
COPY scripts ./scripts
RUN bash scripts/setup.sh

CMD ["python", "-m", "train"]
