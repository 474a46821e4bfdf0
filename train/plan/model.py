"""A training run at scale, term by term (docs/planner.md):

    step = N x compute(per-GPU batch) + exposed all-reduce + optimizer step, no faster than the input
    time to train = start-up + steps x step + evaluations

N is the gradient accumulation steps: the batches of every GPU whose gradients one optimizer step
adds up, 1 unless the global batch's share of a GPU does not fit in its memory.

The compute model is fitted here (compute.py does the arithmetic) to calibration.yaml, each point's
step first cleared of the all-reduce and optimizer that the same model gives its machine.
"""
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from train.config import Config
from train.batches import phase_split
from train.errors import UsageError
from train.plan import comm, compute
from train.plan.hardware import GPUS, MEMORY_EFFICIENCY, CustomNetwork, Gpu, gpu as gpu_spec, in_node_link, network_link
from train.rules import interpolate
from train.crops import largest_image_size, resolution_ramp
from train.schedule import batch_phases
from train.stopping import interval as agreement_interval
from train.score.flops import IMAGENET_TRAIN_IMAGES, valid_flops

IMAGENET_VAL_IMAGES = 50_000
BACKWARD_SHARE = 2 / 3  # backward is two thirds of a training step's FLOPs (forward one third)
OPTIMIZER_BYTES_PER_PARAM = 28  # LARS: reads weight, gradient, momentum; writes weight, momentum; norms read w, g again
DEFAULT_OVERLAP = 0.75  # share of the all-reduce hidden behind backward (bucketed overlap)
DEFAULT_STARTUP_S = 5.0  # run start to the first step
WIRE_BYTES = {"fp16": 2, "fp32": 4}
# The ranks' agreement on stopping (train/stopping.py): an all-reduce of a few numbers over gloo on the
# hosts, a ring of 2 (ranks - 1) hops, each through both hosts' TCP stacks (assumed: 25 us a hop)
HOST_HOP_S = 25e-6
MLPERF_TARGET = 0.759
# Input pipeline ceilings, images/s per GPU: DALI decoding on the GPU, and CPU decoding per core.
DALI_GPU_IMG_S = 7950  # at least this: the fastest per-GPU rate published with DALI (8 H200)
CPU_DECODE_IMG_S_PER_CORE = 280  # DALI CPU pipeline measured on this project's machine: 560 img/s on 2 threads
# MLPerf reference convergence points: global batch -> mean epochs to 75.9% top-1 (docs/learning_rate.md, docs/mlperf.md)
MLPERF_EPOCHS = {1632: 35.0, 3264: 35.2, 4096: 40.0, 8192: 42.0, 13056: 45.4, 32768: 56.0, 49152: 68.0,
                 58880: 79.9, 65536: 84.5, 67840: 85.9}


@dataclass(frozen=True)
class Machine:
    gpu: Gpu
    gpus_per_node: int
    network: str | CustomNetwork  # a named network, or --network custom's link
    links_per_node: int
    in_node: str = "nvlink"

    def cluster(self, gpus: int) -> comm.Cluster:
        return comm.Cluster(gpus, min(gpus, self.gpus_per_node), in_node_link(self.gpu, self.in_node),
                            network_link(self.network, self.links_per_node))


@dataclass(frozen=True)
class PlannedSystem:
    """What is planned, everything a plan depends on besides the GPU count: the preset's settings, the
    machine, the GPU's fitted compute, the all-reduce and what the planner assumes around them."""
    preset: str
    cfg: Config
    machine: Machine
    fit: compute.Fit
    allreduce: str
    torus_rows: int = 0
    overlap: float = DEFAULT_OVERLAP
    wire: str = "fp16"
    input_cap: float = DALI_GPU_IMG_S  # images/s per GPU the input pipeline can deliver
    per_gpu_batch: int = 0  # 0: keep the preset's global batch
    startup_s: float = DEFAULT_STARTUP_S
    top1: float = MLPERF_TARGET
    notes: list = field(default_factory=list)


class Skip(Exception):
    """This GPU count cannot run the preset (the reason is the message)."""


def optimizer_seconds(spec: Gpu, params: int) -> float:
    return params * OPTIMIZER_BYTES_PER_PARAM / (spec.hbm_bytes_per_s * MEMORY_EFFICIENCY)


def nodes_of(gpus: int, gpus_per_node: int) -> int:
    """Nodes for a GPU count: fewer GPUs than a node's are one partly used node."""
    if gpus < 1:
        raise UsageError(f"a GPU count must be positive, got {gpus}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise UsageError(f"{gpus} GPUs do not divide into nodes of {gpus_per_node}; "
                         f"choose a multiple of --gpus-per-node {gpus_per_node}")
    return max(1, gpus // gpus_per_node)


def parameter_count(arch: str) -> int:
    from models.memory import parameter_count as counted  # (models/ loads torch: not for --help)
    return counted(arch)


def max_per_gpu_batch(spec: Gpu, params: int, image_size: int) -> int:
    """The largest per-GPU batch whose step fits in the GPU's memory (activations scale with pixels):
    the model's own memory model, models/memory.py."""
    from models.memory import fitting_batch
    return fitting_batch(spec.memory_bytes, params, image_size)


def check_rows(gpus: int, rows: int) -> None:
    if rows and gpus % rows:
        raise UsageError(f"--torus-rows {rows} does not divide {gpus} GPUs; choose a divisor of every count")


# ---- calibration ----

def load_calibration(path: Path | None = None) -> dict:
    text = Path(path).read_text() if path else resources.files("train.plan").joinpath("calibration.yaml").read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"calibration file {path} is not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("published", []), list):
        raise UsageError(f"calibration file {path} must be a mapping with a list `published`")
    return data


def _point_compute_s(point: dict, params: int) -> tuple[float, float]:
    """(per-GPU batch, compute seconds) of a calibration point: its measured step less the exposed
    all-reduce and the optimizer step that the model gives its own machine."""
    spec = gpu_spec(point["gpu"])
    batch, step = point["per_gpu_batch"], point["per_gpu_batch"] / point["img_per_s"]
    gpus = point.get("gpus", 1)
    machine = Machine(spec, point.get("gpus_per_node", 1), point.get("network", "ib-edr"), point.get("links_per_node", 1))
    comm_s = comm.allreduce_time(machine.cluster(gpus), params * WIRE_BYTES["fp16"], point.get("allreduce", "flat"),
                                 nccl=True)
    base = step
    for _ in range(5):  # the step without the ranks' agreement on stopping, which the plan adds to it
        base = step - agreement_per_step(gpus, base)
    step = base
    seconds = compute.compute_from_step(step, comm_s, optimizer_seconds(spec, params), DEFAULT_OVERLAP, BACKWARD_SHARE)
    return batch, seconds


def fit_gpu(name: str, calibration: dict, params: int, fixed_cost_scale: float = 1.0) -> compute.Fit:
    """The compute model of one GPU: its measured figures (gpu_check) when they span two batches,
    else its published points; one batch only: the reference GPU's knee x fixed_cost_scale."""
    def points_of(kind: str, gpu: str) -> list[dict]:
        return [p for p in calibration.get(kind) or [] if str(p.get("gpu", "")).lower() == gpu]

    measured = points_of("measured", name)
    if len({p["per_gpu_batch"] for p in measured}) >= 2:
        chosen, what = measured, "measured by gpu_check"
    else:
        chosen, what = points_of("published", name), "published"
    if not chosen:
        raise UsageError(f"no calibration figures for --gpu {name} in the calibration file")
    pairs = [_point_compute_s(p, params) for p in chosen]
    batches = sorted({b for b, _ in pairs})
    peak = max(p["img_per_s"] for p in chosen)
    if len(batches) >= 2:
        fixed, per_image = compute.affine(pairs)
        return compute.Fit(name, fixed, per_image, f"{what}, {len(pairs)} points at batches "
                                                    f"{', '.join(str(b) for b in batches)}", peak)
    reference = str(calibration.get("reference_gpu", "h100"))
    if reference == name:
        raise UsageError(f"the reference GPU {name} needs calibration points at two per-GPU batches")
    knee = fit_gpu(reference, calibration, params).knee * fixed_cost_scale
    fixed, per_image = compute.one_point(*pairs[0], knee)
    return compute.Fit(name, fixed, per_image, f"{what}, 1 point at batch {batches[0]}; fixed cost assumed: "
                                               f"{reference}'s knee {knee:.1f} images" +
                                               (f" ({fixed_cost_scale:g} x)" if fixed_cost_scale != 1 else ""), peak)


# ---- the run ----

def mlperf_epochs(global_batch: int) -> float:
    """Mean epochs to 75.9% from the MLPerf reference table, linear in log2(batch) between its
    points, held at its ends (as train.rules interpolates the LR)."""
    return interpolate({b: (e,) for b, e in MLPERF_EPOCHS.items()}, global_batch, 0)


def mlperf_epochs_reason(global_batch: int) -> str:
    """How mlperf_epochs(global_batch) was found: a point of the table, between two, or held at an end."""
    smallest, largest = min(MLPERF_EPOCHS), max(MLPERF_EPOCHS)
    if global_batch < smallest:
        return f"below the table: held at its smallest, {smallest:,}: {MLPERF_EPOCHS[smallest]:g} epochs"
    if global_batch > largest:
        return f"above the table: held at its largest, {largest:,}: {MLPERF_EPOCHS[largest]:g} epochs"
    return "the table's own" if global_batch in MLPERF_EPOCHS else "interpolated"


def pixel_share(image_size: int) -> float:
    """A crop's work against the calibration points' 224 px: convolutions cost by the pixel."""
    return (image_size / 224) ** 2


def compute_seconds(system: PlannedSystem, per_gpu_batch: int, image_size: int) -> float:
    """A training step's compute at `image_size`: the fit's fixed cost, and its cost per image scaled
    by the pixels."""
    return system.fit.seconds(per_gpu_batch * pixel_share(image_size))  # (in 224 px images' worth of work)


def step_terms(system: PlannedSystem, gpus: int, per_gpu_batch: int, image_size: int = 224,
               accumulation_steps: int = 1) -> dict:
    """One training step of every GPU at crops of `image_size` px: compute (of all its
    `accumulation_steps` batches), the all-reduce (all of it and the part left exposed after the last
    batch's backward), the optimizer step, and the step time, no shorter than the input pipeline
    allows nor faster per image than the GPU's fastest measured point (scaled by the pixels)."""
    params = parameter_count(system.cfg.arch)
    batch_compute_s = compute_seconds(system, per_gpu_batch, image_size)
    compute_s = accumulation_steps * batch_compute_s
    cluster, nbytes = system.machine.cluster(gpus), params * WIRE_BYTES[system.wire]
    comm_total = comm.allreduce_time(cluster, nbytes, system.allreduce, system.torus_rows, nccl=True)
    # only the last batch's backward has the gradients the all-reduce sends: it alone hides it
    comm_s = comm.exposed(comm_total, batch_compute_s, system.overlap, BACKWARD_SHARE)
    optimizer_s = optimizer_seconds(system.machine.gpu, params)
    step = compute_s + comm_s + optimizer_s
    images = per_gpu_batch * accumulation_steps
    # the fastest point's rate holds each batch with its optimizer update; a step makes N - 1 fewer updates
    input_s = images / system.input_cap
    peak_s = images * pixel_share(image_size) / system.fit.peak_img_s - (accumulation_steps - 1) * optimizer_s
    agreement_s = agreement_per_step(gpus, max(step, input_s, peak_s))
    step += agreement_s
    nccl = comm.nccl_choice(cluster, nbytes)[0] if system.allreduce == "flat" and gpus > 1 else None
    return {"per_gpu_batch": per_gpu_batch, "accumulation_steps": accumulation_steps,
            "global_batch": images * gpus, "image_size": image_size, "compute_s": compute_s,
            "comm_s": comm_s, "comm_total_s": comm_total, "optimizer_s": optimizer_s, "agreement_s": agreement_s,
            "step_s": max(step, input_s, peak_s), "input_bound": input_s > max(step, peak_s),
            "peak_bound": peak_s > max(step, input_s) * (1 + 1e-9), "nccl_algorithm": nccl}  # not at the point itself


def agreement_per_step(gpus: int, step_s: float) -> float:
    """The ranks' agreement on stopping, per step: one agreement of 2 (gpus - 1) host hops every
    train/stopping.py interval of steps (0 on one GPU: nothing to agree)."""
    if gpus == 1:
        return 0.0
    agreement_s = 2 * (gpus - 1) * HOST_HOP_S
    return agreement_s / agreement_interval(agreement_s, step_s)


def phases(system: PlannedSystem, gpus: int, fits: int) -> tuple[list[tuple[float, int, int]], float, str]:
    """([(epochs, per-GPU batch, accumulation steps)] of each batch phase, epochs in all, where the
    epochs come from), a GPU holding at most `fits` images (Skip where no phase's batch can)."""
    spec = system.machine.gpu
    room = (f"in the {spec.name}'s {spec.memory_bytes / 1e9:.0f} GB (at most {fits:,} images of "
            f"{largest_image_size(system.cfg)} px; docs/planner.md)")
    if system.per_gpu_batch:  # the batch is given: accumulating cannot make it fit
        if system.per_gpu_batch > fits:
            raise Skip(f"per-GPU batch {system.per_gpu_batch:,} does not fit {room}")
        global_batch = system.per_gpu_batch * gpus
        epochs = mlperf_epochs(global_batch)
        return ([(epochs, system.per_gpu_batch, 1)], epochs,
                f"MLPerf table at global batch {global_batch:,} ({mlperf_epochs_reason(global_batch)})")
    changes = batch_phases(system.cfg)
    if system.preset.startswith("mlperf-") and len(changes) == 1:
        epochs, source = mlperf_epochs(changes[0][1]), "MLPerf reference mean epochs to 75.9%"
    else:
        epochs, source = float(system.cfg.epochs), "preset"
    spans, accumulated = [], 1  # a phase keeps the previous one's N where its batch can follow
    for i, (start, global_batch) in enumerate(changes):
        end = changes[i + 1][0] if i + 1 < len(changes) else epochs
        if global_batch % gpus:
            raise Skip(f"global batch {global_batch:,} does not divide over {gpus} GPUs")
        if fits < 1:
            raise Skip(f"per-GPU batch 1 does not fit {room}: no accumulation carries global batch {global_batch:,}")
        # the trainer's split: the fewest steps from the previous phase's up whose batch is whole and fits
        batch, accumulated = phase_split(global_batch, gpus, accumulated, fits)
        if end > start:
            spans.append((end - start, batch, accumulated))
    return spans, epochs, source


def resolution_spans(cfg: Config, start: float, end: float) -> list[tuple[float, int]]:
    """[(epochs, training crop size)] from epoch `start` to `end` (fractional): --image-size
    throughout, or --resolution-schedule's size of each epoch, equal neighbours merged."""
    ramp = resolution_ramp(cfg.resolution_schedule)
    if ramp is None:
        return [(end - start, cfg.image_size)]
    spans = []
    for epoch in range(math.floor(start), math.ceil(end)):
        length = min(end, epoch + 1) - max(start, epoch)
        if spans and spans[-1][1] == ramp(epoch):
            spans[-1] = (spans[-1][0] + length, spans[-1][1])
        elif length > 0:
            spans.append((length, ramp(epoch)))
    return spans


def plan(system: PlannedSystem, gpus: int) -> dict:
    """The run on `gpus` GPUs: one row of the planner's output (Skip when the batch does not divide,
    or no accumulation makes a GPU's share of it fit)."""
    from models import eval_flops_per_image, train_flops_per_image  # (loads torch: not for --help)
    nodes = nodes_of(gpus, system.machine.gpus_per_node)
    check_rows(gpus, system.torus_rows if system.allreduce == "torus" else 0)
    fits = max_per_gpu_batch(system.machine.gpu, parameter_count(system.cfg.arch), largest_image_size(system.cfg))
    spans, epochs, epochs_source = phases(system, gpus, fits)
    steps_total = train_s = eval_s = trained = flop = 0.0
    evals = math.ceil(epochs / system.cfg.eval_every) if system.cfg.eval_every else 1
    eval_size = system.cfg.eval_image_size or system.cfg.image_size
    arch, blurpool = system.cfg.arch, system.cfg.blurpool  # (the FLOPs of the model the run builds)
    passes = 2 if system.cfg.eval_flip else 1  # --eval-flip: each image and its mirror image pass the model
    terms, start = [], 0.0
    for span_epochs, batch, accumulated in spans:
        eval_steps = math.ceil(math.ceil(IMAGENET_VAL_IMAGES / gpus) / batch)
        # an evaluation step is a forward pass a batch (two with flips): a third of a training step's compute
        eval_s += (evals * span_epochs / epochs * eval_steps * passes * (1 - BACKWARD_SHARE)
                   * compute_seconds(system, batch, eval_size))
        for size_epochs, size in resolution_spans(system.cfg, start, start + span_epochs):  # (progressive resizing)
            step = step_terms(system, gpus, batch, size, accumulated)
            steps = math.ceil(size_epochs * IMAGENET_TRAIN_IMAGES / step["global_batch"])
            steps_total += steps
            train_s += steps * step["step_s"]
            trained += steps * step["global_batch"]
            flop += round(size_epochs * IMAGENET_TRAIN_IMAGES) * train_flops_per_image(arch, size, blurpool=blurpool)
            terms.append({**step, "epochs": size_epochs, "steps": steps})
        start += span_epochs
    # the work of the evaluations too, as train.score counts a run's: each validation image once an evaluation
    flop += evals * IMAGENET_VAL_IMAGES * passes * eval_flops_per_image(arch, eval_size, blurpool=blurpool)
    time_to_train = system.startup_s + train_s + eval_s
    flops = flop / time_to_train
    first = terms[0]
    row = {"gpus": gpus, "nodes": nodes, "per_gpu_batch": first["per_gpu_batch"],
           "accumulation_steps": first["accumulation_steps"], "global_batch": first["global_batch"],
           "compute_s": first["compute_s"], "comm_s": first["comm_s"], "comm_total_s": first["comm_total_s"],
           "optimizer_s": first["optimizer_s"], "agreement_s": first["agreement_s"], "step_s": first["step_s"],
           "input_bound": first["input_bound"],
           "peak_bound": first["peak_bound"], "nccl_algorithm": first["nccl_algorithm"],
           "img_per_s": trained / train_s, "img_per_s_per_gpu": trained / train_s / gpus, "epochs": epochs,
           "epochs_source": epochs_source, "steps": steps_total, "evals": evals, "eval_s": eval_s,
           "startup_s": system.startup_s, "train_s": train_s, "time_to_train_s": time_to_train, "flops": flops,
           "top1": system.top1, "valid_flops": valid_flops(flops, system.top1), "allreduce": system.allreduce}
    if len(terms) > 1:
        row["phases"] = terms
    return row


def known_gpus() -> tuple[str, ...]:
    return tuple(GPUS)
