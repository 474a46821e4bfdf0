"""What is trained: torchvision's ResNets (ResNet-50 is v1.5), their FLOP counts, and what a training
step of them holds in GPU memory (models/memory.py, which the planner imports where it needs it)."""
from models.resnet import ARCHS, build_model, first_misfit
from models.flops import train_flops_per_image, eval_flops_per_image

__all__ = ["ARCHS", "build_model", "first_misfit", "train_flops_per_image", "eval_flops_per_image"]
