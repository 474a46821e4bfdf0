"""Training step time of the compiled model (--compile) / the eager model's, the trainer's step.

The step is the trainer's: build_model's ResNet (channels-last), label-smoothed cross-entropy under
the run's precision (auto: bf16 on Ampere+ GPUs, fp32 on CPU), backward, the LARS step. Two copies of
the same model, one compiled in place as the trainer compiles it (--mode: torch.compile's mode), step
on one fixed random batch. The compiled model's first step (the compilation; shorter when
Inductor's on-disk cache already holds it) is timed apart; then both warm up, and the two take turns,
a block of steps each, three rounds. Step times are medians of the per-step times (each step waits
for the device); the ratio is the median of the three rounds' ratios.
Last line: `compile_step_ratio: R (goal <1 on GPU)`, R = compiled / eager step time.

On a GPU, kernel launches bound a ResNet step at small per-GPU batches (16 to 32 images): that is
where compiling (and the CUDA graphs of reduce-overhead and max-autotune) pays; on a CPU it does not.
"""
import argparse
import copy
import logging
import statistics
import time

import torch

from models import ARCHS, build_model
from train.cli import COMPILE_MODES
from train.lars import LARS, decay_param_groups
from train.precision import Precision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet50", choices=ARCHS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=32, help="images per step (per GPU)")
    parser.add_argument("--mode", default="default", choices=COMPILE_MODES, help="torch.compile's mode")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each model per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each model before the rounds")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":  # as the trainer sets them
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # (a GPU-less host with nvcc: "No CUDA runtime")
    precision = Precision(args.precision, device)
    torch.manual_seed(0)
    eager = build_model(args.arch, 1000, zero_init_residual=True, channels_last=True).to(device)
    compiled = copy.deepcopy(eager)
    compiled.compile(mode=args.mode)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    steps = {model: make_step(model, criterion, precision, images, labels) for model in (eager, compiled)}

    compile_seconds = timed(steps[compiled], device)
    for _ in range(args.warmup):
        for step in steps.values():
            timed(step, device)
    times, ratios = {eager: [], compiled: []}, []
    for _ in range(3):
        medians = {}
        for model, step in steps.items():
            this_round = [timed(step, device) for _ in range(args.steps)]
            times[model] += this_round
            medians[model] = statistics.median(this_round)
        ratios.append(medians[compiled] / medians[eager])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{args.arch} at {args.image_size} px, batch {args.batch_size}, {precision.name} on {where}; "
          f"mode {args.mode}: the first compiled step (the compilation) took {compile_seconds:.1f} s")
    print(f"eager step median {statistics.median(times[eager]) * 1e3:.2f} ms   "
          f"compiled step median {statistics.median(times[compiled]) * 1e3:.2f} ms   "
          f"(rounds' ratios {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"compile_step_ratio: {statistics.median(ratios):.3f} (goal <1 on GPU)")


def make_step(model, criterion, precision, images, labels):
    # LR 0: the step runs every kernel of a real one, and the weights stay as built: every step times the same model
    optimizer = LARS(decay_param_groups(model), lr=0.0, momentum=0.9, weight_decay=5e-5)
    model.train()

    def step():
        with precision.autocast():
            loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def timed(step, device) -> float:
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
