"""The names each choice setting takes (--loader NAME, --arch NAME, ...), without importing torch: the
command line shows and checks them before a run starts (--help prints in well under two seconds). The
registries that serve them (data.LOADERS, models.ARCHS, train.optim.OPTIMIZERS, ...) must hold exactly
these names (tests/test_layout.py checks)."""

LOADERS = ("torch", "dali", "synthetic")
DALI_DECODE = ("auto", "cpu", "gpu")
ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "resnext101_32x8d",
         "resnext101_64x4d", "wide_resnet50_2", "wide_resnet101_2")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = ("lars", "sgd", "rmsprop-warmup")
SCHEDULES = ("warmup-poly", "cosine", "linear", "multistep", "phases")
ENGINES = ("none", "torch", "horovod")
ALLREDUCE = ("flat", "hierarchical", "torus")
DIVISIONS = ("open", "closed")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # "default": torch's own
