"""The run's settings: one field per setting, with its default and its help. Where the values come
from (defaults < preset < the saved config of a --resume'd run < command-line flags) and which values
are allowed is train/cli.py's business; what they resolve to once the rank count is known (the global
batch, the LR and warmup, the class count) is train/startup.py's.

Every field is a flag with the usual spelling (batch_size -> --batch-size), and says of itself what
the command line and start-up need to know: its --help text and argument group, the names it takes
(a choice setting: the names of its registry where that registry loads without torch, data.LOADER_NAMES,
models.ARCHS, schedule.SCHEDULES; the optimizers' and engines' registries refuse a name not listed here),
and whether it defines the run (a run directory holding a run with another value of it is refused).
"""
import dataclasses
from dataclasses import dataclass, field, fields

from data import LOADER_NAMES
from models import ARCHS
from train.crops import MAX_CROP, MIN_CROP
from train.schedule import SCHEDULES

# --help's argument groups, by the task a user looks for a flag under, in --help's order
DATA, MODEL, OPTIMIZER, SPEED, DISTRIBUTED, BATCHNORM, CHECKPOINTS, EVALUATION, LOGGING, PRESETS = (
    "data and loader", "model", "optimizer and schedule", "precision and speed", "distributed and all-reduce",
    "BatchNorm", "checkpoints and resume", "evaluation", "logging", "presets and recipes")


# The values a number setting may take (setting(..., bounds=)): (test, what the refusal says it must be).
# A float must be finite as well; every int and float field has bounds (tests/test_validation.py checks).
ZERO_OR_MORE = (lambda v: v >= 0, "0 or more")
AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
ABOVE_0 = (lambda v: v > 0, "more than 0")
BELOW_1 = (lambda v: 0 <= v < 1, "in [0, 1)")
# one rule for every crop size, training and evaluation alike; the upper bound stops a typo (100000 px) here,
# not at an allocation of over 100 GB once the run has started
CROP_SIZE = f"a crop size from {MIN_CROP} to {MAX_CROP} px"


def setting(default, help: str, group: str, *, defines_run: bool = False, choices: tuple = (), bounds: tuple = (),
            metavar: str = ""):
    """A Config field. `bounds` (a number setting's): (test, what a refused value must be).
    `defines_run`: the same command started again must give the same value (after
    start-up resolved it: the LR and warmup chosen from the global batch, the class count found in the
    data); run-length, logging, checkpoint and input-thread settings may change from one start to the next."""
    metadata = {"help": help, "group": group, "defines_run": defines_run, "choices": choices, "bounds": bounds}
    return field(default=default, metadata={**metadata, "metavar": metavar} if metavar else metadata)


@dataclass(frozen=True)
class Config:
    """The settings as the user gave them (flags over the saved run over the preset over the defaults):
    0, -1 and "auto" still say "choose for me"."""
    # data
    data_dir: str = setting("", "ImageNet-layout tree (train/<class>/, val/<class>/) or a folder of tar shards (scripts/make_shards.py) (default: the embedded dataset)", DATA, defines_run=True, metavar="PATH")
    loader: str = setting("auto", "input pipeline; auto: DALI decoding on the GPU where there is a GPU and DALI's CUDA build, else torch (docs/gpu.md)", DATA, defines_run=True, choices=("auto", *LOADER_NAMES))
    dali_decode: str = setting("auto", "where --loader dali decodes JPEGs; auto: on the GPU where there is one (nvJPEG), else on the CPU", DATA, choices=("auto", "cpu", "gpu"))
    workers: int = setting(4, "input threads per rank: the torch loader's decoding threads; DALI's reader processes and CPU threads (at least 6 CPU threads per GPU where nvJPEG decodes: docs/gpu.md)", DATA, bounds=ZERO_OR_MORE)
    threads: int = setting(0, "compute threads per rank (0: OMP_NUM_THREADS, else the host's cores shared by its ranks) (docs/settings.md#--threads)", SPEED, bounds=ZERO_OR_MORE)
    image_size: int = setting(224, "training crop size in pixels, 16 to 1024; given alone, the run trains at it throughout (docs/settings.md#--image-size)", DATA, defines_run=True, bounds=(lambda v: MIN_CROP <= v <= MAX_CROP, CROP_SIZE))
    resolution_schedule: str = setting("", "progressive resizing: crops from START to END px between epochs FROM and TO, e.g. 160:192:65:76 (docs/settings.md#--resolution-schedule) (default: --image-size throughout)", DATA, defines_run=True, metavar="START:END:FROM:TO")
    crop_min_scale: float = setting(0.08, "smallest area fraction of random-resized-crop", DATA, defines_run=True, bounds=(lambda v: 0 < v <= 1, "in (0, 1]"))
    crop_max_scale: float = setting(1.0, "largest area fraction of random-resized-crop", DATA, defines_run=True, bounds=(lambda v: 0 < v <= 1, "in (0, 1]"))
    crop_min_aspect: float = setting(3 / 4, "smallest aspect ratio of random-resized-crop", DATA, defines_run=True, bounds=ABOVE_0)
    crop_max_aspect: float = setting(4 / 3, "largest aspect ratio of random-resized-crop", DATA, defines_run=True, bounds=ABOVE_0)
    synthetic_images: int = setting(1_281_167, "training-set size of --loader synthetic", DATA, defines_run=True, bounds=AT_LEAST_1)
    synthetic_val_images: int = setting(50_000, "validation-set size of --loader synthetic (0: none, and no evaluation)", DATA, bounds=ZERO_OR_MORE)
    synthetic_classes: int = setting(1000, "classes of --loader synthetic", DATA, defines_run=True, bounds=AT_LEAST_1)
    num_classes: int = setting(0, "classes the data must have (0: as many as it has); a run records its count in config.yaml", DATA, defines_run=True, bounds=ZERO_OR_MORE)
    # model
    arch: str = setting("resnet50", "a torchvision ResNet", MODEL, defines_run=True, choices=ARCHS)
    zero_init_residual: bool = setting(True, "zero the last BN gamma of every residual block", MODEL, defines_run=True)
    blurpool: bool = setting(False, "blur before every strided convolution past the stem, against aliasing (FFCV's BlurPool) (docs/time_to_accuracy.md)", MODEL, defines_run=True)
    ema_decay: float = setting(0.0, "decay of a moving average of the weights, which evaluations and exports use (e.g. 0.9999; 0: off) (docs/settings.md#--ema-decay)", MODEL, defines_run=True, bounds=BELOW_1)
    channels_last: bool = setting(True, "NHWC memory format for model and batches", SPEED)
    compile: bool = setting(False, "compile the model with torch.compile (fewer kernel launches at small per-GPU batches; the first step and the first evaluation compile; docs/compile.md)", SPEED)
    compile_mode: str = setting("default", "torch.compile's mode for --compile: reduce-overhead and max-autotune replay CUDA graphs on a GPU (default: torch's own)", SPEED, choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    bn_group_size: int = setting(0, "ghost BatchNorm: statistics over groups of this many images inside a rank's batch (0: the whole per-rank batch); with --bn-span S, group i of S ranks together", BATCHNORM, bounds=ZERO_OR_MORE)
    bn_recompute_batches: int = setting(0, "BatchNorm without moving averages: before each evaluation, statistics recomputed over the last K training batches, averaged over all ranks (0: running averages)", BATCHNORM, bounds=ZERO_OR_MORE)
    init_from_seed: bool = setting(False, "every rank builds the initial model from --seed instead of receiving rank 0's by broadcast (a checksum checks they agree)", MODEL)
    precision: str = setting("auto", "fp16 is CUDA only; auto: bf16 from compute capability 8.0 up (A100, H100), fp16 with loss scaling below (V100, T4), fp32 on CPU (docs/precision.md)", SPEED, choices=("auto", "fp32", "bf16", "fp16"))
    # optimisation
    optimizer: str = setting("lars", "the update rule: LARS with MLPerf's semantics (docs/lars.md), momentum SGD, or RMSprop handing over to SGD (docs/seed_systems.md)", OPTIMIZER, defines_run=True, choices=("lars", "sgd", "rmsprop-warmup"))
    lr_schedule: str = setting("warmup-poly", "how the LR moves after the linear warmup: polynomial decay to --end-lr (MLPerf's), steps at --lr-decay-epochs, --lr-phases, or a cosine or a straight line down to 0 at the last step", OPTIMIZER, defines_run=True, choices=tuple(SCHEDULES))
    batch_size: int = setting(0, "images per rank per step (0: --global-batch-size / ranks; when neither is set, on a GPU the largest multiple of 16 up to 512 whose step fits its memory, 256 on a CPU)", OPTIMIZER, bounds=(lambda v: v >= 0, "positive"))
    global_batch_size: int = setting(0, "images per optimizer step over all ranks: ranks x --batch-size x --accumulation-steps (0: --batch-size x ranks)", OPTIMIZER, defines_run=True, bounds=(lambda v: v >= 0, "positive"))
    accumulation_steps: int = setting(0, "batches per rank whose gradients add up into one optimizer step (0: 1, or the fewest that fit) (docs/accumulation.md)", OPTIMIZER, bounds=ZERO_OR_MORE)
    batch_schedule: str = setting("", "batch-size control: 'E:B,...' = global batch B after E epochs (e.g. '30:69632'); per-rank batch and LR follow", OPTIMIZER, defines_run=True)
    epochs: int = setting(90, "length of the run and of the LR schedule", OPTIMIZER, bounds=(lambda v: v >= 1, "positive"))
    lr: float = setting(0.0, "peak learning rate for the global batch (0: chosen from the global batch, see docs/learning_rate.md)", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    lr_per_256: float = setting(0.0, "if set, peak LR = this x global batch / 256", OPTIMIZER, bounds=ZERO_OR_MORE)
    warmup_epochs: float = setting(-1.0, "linear warmup length in epochs (-1: chosen from the global batch)", OPTIMIZER, defines_run=True, bounds=(lambda v: v >= 0 or v == -1, "0 or more (-1: chosen from the global batch)"))
    end_lr: float = setting(1e-4, "LR at the last step of the polynomial decay", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    lr_decay_power: float = setting(2.0, "power of the polynomial decay", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    warmup_start_lr: float = setting(0.0, "LR the warmup ramps up from, per step (0: from 0)", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    lr_decay_epochs: str = setting("30,60,80", "--lr-schedule multistep: epochs after which the LR is multiplied by --lr-decay-factor", OPTIMIZER, defines_run=True)
    lr_decay_factor: float = setting(0.1, "--lr-schedule multistep: LR factor at each --lr-decay-epochs", OPTIMIZER, defines_run=True, bounds=(lambda v: 0 < v <= 1, "in (0, 1]"))
    lr_phases: str = setting("", "--lr-schedule phases: 'EPOCHS:FACTOR,...' = the peak LR x FACTOR for that many epochs (slow start)", OPTIMIZER, defines_run=True)
    nesterov: bool = setting(False, "Nesterov momentum (--optimizer sgd)", OPTIMIZER, defines_run=True)
    sgd_share_center: float = setting(10.0, "--optimizer rmsprop-warmup: epoch at which the momentum-SGD share of the update passes 1/2", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    sgd_share_width: float = setting(5.0, "--optimizer rmsprop-warmup: epochs over which the SGD share rises from 0 to 1", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    rmsprop_lr_ratio: float = setting(0.001, "--optimizer rmsprop-warmup: the RMSprop term's LR as a fraction of the LR", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    rmsprop_alpha: float = setting(0.99, "--optimizer rmsprop-warmup: decay of the squared-gradient average", OPTIMIZER, defines_run=True, bounds=BELOW_1)
    rmsprop_epsilon: float = setting(1e-8, "--optimizer rmsprop-warmup: added to the RMS", OPTIMIZER, defines_run=True, bounds=ABOVE_0)
    momentum: float = setting(0.9, "momentum of the SGD and LARS updates", OPTIMIZER, defines_run=True, bounds=BELOW_1)
    weight_decay: float = setting(5e-5, "L2 weight decay (LARS and SGD leave BatchNorm and bias parameters out)", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    lars_eta: float = setting(0.001, "LARS trust coefficient", OPTIMIZER, defines_run=True, bounds=ABOVE_0)
    lars_epsilon: float = setting(0.0, "added to the norms of LARS's trust ratio", OPTIMIZER, defines_run=True, bounds=ZERO_OR_MORE)
    lars_compile: bool = setting(False, "run the LARS update through torch.compile (fewer passes over memory; the first step compiles)", SPEED)
    label_smoothing: float = setting(0.1, "label smoothing of the cross-entropy loss", OPTIMIZER, defines_run=True, bounds=BELOW_1)
    augment_off_epoch: int = setting(0, "from this epoch on (counted from 1) training images get the evaluation transform, no random crop or flip (0: never)", DATA, defines_run=True, bounds=ZERO_OR_MORE)
    # evaluation
    eval_every: int = setting(4, "evaluate every N epochs (0: never)", EVALUATION, bounds=ZERO_OR_MORE)
    eval_offset: int = setting(0, "evaluate after epoch e when (e + offset) %% eval_every == 0", EVALUATION, bounds=ZERO_OR_MORE)
    eval_image_size: int = setting(0, "evaluation crop size in pixels, 16 to 1024 (0: --image-size); --test-only takes it too (docs/settings.md#--eval-image-size)", EVALUATION, bounds=(lambda v: v == 0 or MIN_CROP <= v <= MAX_CROP, f"0 (as --image-size) or {CROP_SIZE}"))
    raw_weights: bool = setting(False, "--test-only: evaluate the weights as trained, not the --ema-decay average the run evaluated and kept (predict and export take --raw-weights too)", EVALUATION)
    eval_flip: bool = setting(False, "test-time augmentation: each evaluation image also mirrored, the two logits averaged (twice the evaluation's forward passes)", EVALUATION)
    target_accuracy: float = setting(0.0, "stop once top-1, a fraction (0.759 for 75.9 percent), reaches this (0: run all epochs)", EVALUATION, bounds=(lambda v: 0 <= v <= 1, "a fraction in (0, 1] (0: run all epochs)"))
    # run
    engine: str = setting("auto", "how the ranks talk: none (one process), torch (torch.distributed), horovod; auto: from the launcher's environment (torchrun, horovodrun, mpirun, srun)", DISTRIBUTED, choices=("auto", "none", "torch", "horovod"))
    allreduce: str = setting("flat", "hierarchical: reduce-scatter in the node, all-reduce across nodes, all-gather; torus: the same on a grid of --torus-rows, half of each bucket each way (docs/allreduce.md)", DISTRIBUTED, choices=("flat", "hierarchical", "torus"))
    ranks_per_node: int = setting(0, "node size for --allreduce hierarchical (0: ranks sharing a host name)", DISTRIBUTED, bounds=ZERO_OR_MORE)
    torus_rows: int = setting(0, "--allreduce torus: ranks in one line of the grid, among which the reduce-scatter runs (0: the ranks per node)", DISTRIBUTED, bounds=ZERO_OR_MORE)
    fp16_allreduce: bool = setting(False, "send gradients in half precision, averaged so that the sum keeps fp16's range (docs/allreduce.md)", DISTRIBUTED)
    ddp_static_graph: str = setting("auto", "torch.distributed: tell DDP that every step uses the same parameters the same way (its static_graph); auto: on GPUs (docs/allreduce.md)", DISTRIBUTED, choices=("auto", "on", "off"))
    bn_span: int = setting(1, "BatchNorm statistics over groups of this many consecutive ranks", BATCHNORM, bounds=AT_LEAST_1)
    stop_check_every: int = setting(0, "steps between the ranks' agreements on a stop signal (0: spaced by what they cost) (docs/settings.md#--stop-check-every)", DISTRIBUTED, bounds=ZERO_OR_MORE)
    out_dir: str = setting("", "run directory (default: runs/<preset>-<time>)", CHECKPOINTS, metavar="PATH")
    seed: int = setting(0, "seed of the initial weights, the data order and the augmentation (a resumed run sees the batches an uninterrupted one would)", PRESETS, defines_run=True, bounds=(lambda v: 0 <= v < 2 ** 32, "in [0, 2**32)"))
    max_steps: int = setting(0, "stop after N optimizer steps (0: no limit)", OPTIMIZER, bounds=ZERO_OR_MORE)
    log_every: int = setting(50, "steps between logging points: a train record in metrics.jsonl and, where no terminal shows the progress bar, a progress line", LOGGING, bounds=AT_LEAST_1)
    tensorboard: bool = setting(True, "also write the train, epoch and eval records as TensorBoard scalars into RUN/tensorboard (rank 0) (default: on where the tensorboard package is installed)", LOGGING)
    save_checkpoints: bool = setting(True, "write checkpoint.pt (--no-save-checkpoints: nothing but the logs, no checkpoint and no kept copy; a restarted run then starts again from step 0)", CHECKPOINTS)
    checkpoint_every: int = setting(1, "epochs between checkpoints (the end is always saved)", CHECKPOINTS, bounds=AT_LEAST_1)
    checkpoint_every_steps: int = setting(0, "also checkpoint every N optimizer steps, written in the background (0: never)", CHECKPOINTS, bounds=ZERO_OR_MORE)
    checkpoint_every_minutes: float = setting(0.0, "also checkpoint every M minutes of training (rank 0's clock, agreed by all ranks), written in the background (0: never)", CHECKPOINTS, bounds=ZERO_OR_MORE)
    keep_checkpoints: int = setting(0, "also keep the last N epochs' checkpoints and the best one's (0: only checkpoint.pt) (docs/settings.md#--keep-checkpoints)", CHECKPOINTS, bounds=ZERO_OR_MORE)
    commit_every: int = setting(50, "Horovod Elastic: commit the state to host memory every N steps (and at epoch ends); a lost worker costs the steps since", DISTRIBUTED, bounds=AT_LEAST_1)
    resume: bool = setting(False, "continue the run in --out-dir from its checkpoint.pt (the same command does so by itself; --resume insists on a checkpoint and may change settings)", CHECKPOINTS)
    init_from: str = setting("", "start a new run from these weights: a run's checkpoint, a state_dict file or a script's checkpoint (docs/settings.md#--init-from)", CHECKPOINTS, defines_run=True, metavar="PATH")
    left_out: str = field(default="", metadata={"internal": True})  # set by parse: what an explicit --image-size left out, and whose ("--resolution-schedule R of preset P")
    flags_given: tuple = field(default=(), metadata={"internal": True})  # set by parse: the settings named on the command line
    preset_lr_batch: int = field(default=0, metadata={"internal": True})  # set by parse: the global batch of a preset whose lr the run keeps
    show_recipe: bool = setting(False, "print the resolved settings and the per-epoch schedule (global batch, LR, augmentation) as JSON, and stop", PRESETS)
    test_only: bool = setting(False, "evaluate --out-dir's checkpoint on the validation set of its data (or --data-dir) and print top-1/top-5; changes nothing in the run", EVALUATION)
    test_checkpoint: str = setting("", "--test-only evaluates this checkpoint: a file in --out-dir (checkpoint-best.pt, checkpoint-epoch010.pt: --keep-checkpoints) or a path (default: --out-dir's checkpoint.pt)", EVALUATION, metavar="PATH")
    max_bad_steps: int = setting(20, "stop after this many consecutive non-finite losses", OPTIMIZER, bounds=AT_LEAST_1)
    division: str = setting("open", "MLPerf division declared in the log (closed: MLPerf's rules on optimizer and schedule are checked)", LOGGING, choices=("open", "closed"))
    submission_org: str = setting("reference-trainer", "organisation named in the MLPerf log (submission_org)", LOGGING)
    submission_platform: str = setting("", "platform named in the MLPerf log (default: <ranks>x<device name>)", LOGGING)
    preset: str = setting("", "YAML preset name in train/presets or a path (default: smoke without --data-dir)", PRESETS)


@dataclass(frozen=True)
class ResolvedConfig(Config):
    """The settings a run goes by: the Config as typed with what start-up chose for the device, the
    rank count and the data filled in (the loader, the per-rank and global batch, the peak LR and
    warmup, the class count, no evaluation without validation images, the run directory). Made once,
    by train/startup.py (resolved()); whatever holds a ResolvedConfig holds resolved settings, written to
    config.yaml as they are (but for the fields below, which no flag sets)."""
    bn_ghost_group: int = 0  # --bn-group-size where it splits some phase's per-rank batch, else 0 (plain BN)
    largest_batch: int = 0  # the largest per-rank batch a --batch-schedule phase may take before it accumulates more steps


# A setting's old name -> its name now: the old flag still works, and a run directory's config.yaml (or a
# checkpoint's settings) saved under the old key still restarts, resumes and is scored
RENAMED = {"checkpoints": "save_checkpoints", "checkpoint": "test_checkpoint"}

FIELDS = {f.name: f for f in fields(Config) if not f.metadata.get("internal")}

GROUPS = {title: tuple(name for name, f in FIELDS.items() if f.metadata["group"] == title)
          for title in (DATA, MODEL, OPTIMIZER, SPEED, DISTRIBUTED, BATCHNORM, CHECKPOINTS, EVALUATION, LOGGING, PRESETS)}
DEFINING = tuple(name for name, f in FIELDS.items() if f.metadata["defines_run"])
CHOICES = {name: f.metadata["choices"] for name, f in FIELDS.items() if f.metadata["choices"]}  # (no torch: a fast --help)


def to_dict(cfg: Config) -> dict:
    return {name: value for name, value in dataclasses.asdict(cfg).items() if name in FIELDS}
