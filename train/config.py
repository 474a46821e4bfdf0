"""The run's settings: one field per setting, with its default and its help. Where the values come
from (defaults < preset < the saved config of a --resume'd run < command-line flags) and which values
are allowed is train/cli.py's business; what they resolve to once the rank count is known (the global
batch, the LR and warmup, the class count) is train/startup.py's.

Every field is a flag with the usual spelling (batch_size -> --batch-size).
"""
import dataclasses
from dataclasses import dataclass, field, fields


@dataclass
class Config:
    # data
    data_dir: str = field(default="", metadata={"metavar": "PATH", "help": "ImageNet-layout tree (train/<class>/, val/<class>/) or a folder of tar shards (scripts/make_shards.py) (default: the embedded dataset)"})
    loader: str = field(default="auto", metadata={"help": "input pipeline; auto: DALI decoding on the GPU where there is a GPU and DALI's CUDA build, else torch (docs/gpu.md)"})
    dali_decode: str = field(default="auto", metadata={"help": "where --loader dali decodes JPEGs; auto: on the GPU where there is one (nvJPEG), else on the CPU"})
    workers: int = field(default=4, metadata={"help": "input threads per rank: the torch loader's decoding threads, DALI's CPU threads"})
    threads: int = field(default=0, metadata={"help": "compute threads per rank (torch's intra-op threads; 0: OMP_NUM_THREADS if set, else the cores this process may use shared by the ranks on its host, less the loader's --workers on a GPU run, at least 1; docs/threads.md)"})
    image_size: int = field(default=224, metadata={"help": "training crop size in pixels (and the evaluation's unless --eval-image-size)"})
    resolution_schedule: str = field(default="", metadata={"metavar": "START:END:FROM:TO", "help": "progressive resizing (FFCV): training crops of START px until FROM epochs are done, of END px once TO are, between them a straight line rounded to a multiple of 32 (':STEP' after TO rounds to multiples of STEP); START, END and STEP multiples of 8; the evaluation stays at --eval-image-size (or --image-size); e.g. 160:192:65:76 (default: --image-size throughout)"})
    crop_min_scale: float = field(default=0.08, metadata={"help": "smallest area fraction of random-resized-crop"})
    crop_max_scale: float = field(default=1.0, metadata={"help": "largest area fraction of random-resized-crop"})
    crop_min_aspect: float = field(default=3 / 4, metadata={"help": "smallest aspect ratio of random-resized-crop"})
    crop_max_aspect: float = field(default=4 / 3, metadata={"help": "largest aspect ratio of random-resized-crop"})
    synthetic_images: int = field(default=1_281_167, metadata={"help": "training-set size of --loader synthetic"})
    synthetic_val_images: int = field(default=50_000, metadata={"help": "validation-set size of --loader synthetic (0: none, and no evaluation)"})
    synthetic_classes: int = field(default=1000, metadata={"help": "classes of --loader synthetic"})
    num_classes: int = field(default=0, metadata={"help": "classes the data must have (0: as many as it has); a run records its count in config.yaml"})
    # model
    arch: str = field(default="resnet50", metadata={"help": "a torchvision ResNet"})
    zero_init_residual: bool = field(default=True, metadata={"help": "zero the last BN gamma of every residual block"})
    blurpool: bool = field(default=False, metadata={"help": "blur (3x3 binomial filter) before every strided convolution past the stem, against aliasing (FFCV's and Composer's BlurPool); the weights keep torchvision's names and shapes (docs/time_to_accuracy.md)"})
    ema_decay: float = field(default=0.0, metadata={"help": "exponential moving average of the weights, updated after every optimizer step with this decay (e.g. 0.9999); evaluations, --test-only, predict and export then use the averaged weights, and checkpoints keep them (0: off)"})
    channels_last: bool = field(default=True, metadata={"help": "NHWC memory format for model and batches"})
    compile: bool = field(default=False, metadata={"help": "compile the model with torch.compile (fewer kernel launches at small per-GPU batches; the first step and the first evaluation compile; docs/compile.md)"})
    compile_mode: str = field(default="default", metadata={"help": "torch.compile's mode for --compile: reduce-overhead and max-autotune replay CUDA graphs on a GPU (default: torch's own)"})
    bn_group_size: int = field(default=0, metadata={"help": "ghost BatchNorm: statistics over groups of this many images inside a rank's batch (0: the whole per-rank batch); with --bn-span S, group i of S ranks together"})
    bn_recompute_batches: int = field(default=0, metadata={"help": "BatchNorm without moving averages: before each evaluation, statistics recomputed over the last K training batches, averaged over all ranks (0: running averages)"})
    init_from_seed: bool = field(default=False, metadata={"help": "every rank builds the initial model from --seed instead of receiving rank 0's by broadcast (a checksum checks they agree)"})
    precision: str = field(default="auto", metadata={"help": "fp16 is CUDA only; auto: bf16 from compute capability 8.0 up (A100, H100), fp16 with loss scaling below (V100, T4), fp32 on CPU (docs/precision.md)"})
    # optimisation
    optimizer: str = field(default="lars", metadata={"help": "the update rule: LARS with MLPerf's semantics (docs/lars.md), momentum SGD, or RMSprop handing over to SGD (docs/seed_systems.md)"})
    lr_schedule: str = field(default="warmup-poly", metadata={"help": "how the LR moves after the linear warmup: polynomial decay to --end-lr (MLPerf's), steps at --lr-decay-epochs, --lr-phases, or a cosine or a straight line down to 0 at the last step"})
    batch_size: int = field(default=0, metadata={"help": "images per rank per step (0: --global-batch-size / ranks; when neither is set, on a GPU the largest power of two up to 256 whose step fits its memory, 256 on a CPU)"})
    global_batch_size: int = field(default=0, metadata={"help": "images per step over all ranks (0: --batch-size x ranks)"})
    batch_schedule: str = field(default="", metadata={"help": "batch-size control: 'E:B,...' = global batch B after E epochs (e.g. '30:69632'); per-rank batch and LR follow"})
    epochs: int = field(default=90, metadata={"help": "length of the run and of the LR schedule"})
    lr: float = field(default=0.0, metadata={"help": "peak learning rate for the global batch (0: chosen from the global batch, see docs/learning_rate.md)"})
    lr_per_256: float = field(default=0.0, metadata={"help": "if set, peak LR = this x global batch / 256"})
    warmup_epochs: float = field(default=-1.0, metadata={"help": "linear warmup length in epochs (-1: chosen from the global batch)"})
    end_lr: float = field(default=1e-4, metadata={"help": "LR at the last step of the polynomial decay"})
    lr_decay_power: float = field(default=2.0, metadata={"help": "power of the polynomial decay"})
    warmup_start_lr: float = field(default=0.0, metadata={"help": "LR the warmup ramps up from, per step (0: from 0)"})
    lr_decay_epochs: str = field(default="30,60,80", metadata={"help": "--lr-schedule multistep: epochs after which the LR is multiplied by --lr-decay-factor"})
    lr_decay_factor: float = field(default=0.1, metadata={"help": "--lr-schedule multistep: LR factor at each --lr-decay-epochs"})
    lr_phases: str = field(default="", metadata={"help": "--lr-schedule phases: 'EPOCHS:FACTOR,...' = the peak LR x FACTOR for that many epochs (slow start)"})
    nesterov: bool = field(default=False, metadata={"help": "Nesterov momentum (--optimizer sgd)"})
    sgd_share_center: float = field(default=10.0, metadata={"help": "--optimizer rmsprop-warmup: epoch at which the momentum-SGD share of the update passes 1/2"})
    sgd_share_width: float = field(default=5.0, metadata={"help": "--optimizer rmsprop-warmup: epochs over which the SGD share rises from 0 to 1"})
    rmsprop_lr_ratio: float = field(default=0.001, metadata={"help": "--optimizer rmsprop-warmup: the RMSprop term's LR as a fraction of the LR"})
    rmsprop_alpha: float = field(default=0.99, metadata={"help": "--optimizer rmsprop-warmup: decay of the squared-gradient average"})
    rmsprop_epsilon: float = field(default=1e-8, metadata={"help": "--optimizer rmsprop-warmup: added to the RMS"})
    momentum: float = field(default=0.9, metadata={"help": "momentum of the SGD and LARS updates"})
    weight_decay: float = field(default=5e-5, metadata={"help": "L2 weight decay (LARS and SGD leave BatchNorm and bias parameters out)"})
    lars_eta: float = field(default=0.001, metadata={"help": "LARS trust coefficient"})
    lars_epsilon: float = field(default=0.0, metadata={"help": "added to the norms of LARS's trust ratio"})
    lars_compile: bool = field(default=False, metadata={
        "help": "run the LARS update through torch.compile (fewer passes over memory; the first step compiles)"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the cross-entropy loss"})
    augment_off_epoch: int = field(default=0, metadata={"help": "from this epoch on (counted from 1) training images get the evaluation transform, no random crop or flip (0: never)"})
    # evaluation
    eval_every: int = field(default=4, metadata={"help": "evaluate every N epochs (0: never)"})
    eval_offset: int = field(default=0, metadata={"help": "evaluate after epoch e when (e + offset) %% eval_every == 0"})
    eval_image_size: int = field(default=0, metadata={"help": "evaluation crop size in pixels, a multiple of 8 (0: --image-size); above the training size it offsets the smaller apparent object size of random-resized crops (Touvron et al. 2019, FFCV: train at 192, evaluate at 256); --test-only, predict and export take it too"})
    eval_flip: bool = field(default=False, metadata={"help": "test-time augmentation: each evaluation image also mirrored, the two logits averaged (twice the evaluation's forward passes)"})
    target_accuracy: float = field(default=0.0, metadata={"help": "stop once top-1, a fraction (0.759 for 75.9 percent), reaches this (0: run all epochs)"})
    # run
    engine: str = field(default="auto", metadata={"help": "how the ranks talk: none (one process), torch (torch.distributed), horovod; auto: from the launcher's environment (torchrun, horovodrun, mpirun, srun)"})
    allreduce: str = field(default="flat", metadata={"help": "hierarchical: reduce-scatter in the node, all-reduce across nodes, all-gather; torus: the same on a grid of --torus-rows, half of each bucket each way (docs/allreduce.md)"})
    ranks_per_node: int = field(default=0, metadata={"help": "node size for --allreduce hierarchical (0: ranks sharing a host name)"})
    torus_rows: int = field(default=0, metadata={"help": "--allreduce torus: ranks in one line of the grid, among which the reduce-scatter runs (0: the ranks per node)"})
    fp16_allreduce: bool = field(default=False, metadata={"help": "send gradients in half precision: fp16 (bf16 in a bf16 run on torch.distributed; fp32 in a bf16 run on Horovod, which cannot send bf16), averaged so the sum keeps fp16's range (docs/allreduce.md)"})
    bn_span: int = field(default=1, metadata={"help": "BatchNorm statistics over groups of this many consecutive ranks"})
    stop_check_every: int = field(default=0, metadata={"help": "steps between the ranks' agreements on a stop signal (0: spaced by what they cost, at most 0.5 percent of the training time and 30 s of training apart; train/stopping.py)"})
    out_dir: str = field(default="", metadata={"metavar": "PATH", "help": "run directory (default: runs/<preset>-<time>)"})
    seed: int = field(default=0, metadata={"help": "seed of the initial weights, the data order and the augmentation (a resumed run sees the batches an uninterrupted one would)"})
    max_steps: int = field(default=0, metadata={"help": "stop after N optimizer steps (0: no limit)"})
    log_every: int = field(default=50, metadata={"help": "steps between logging points: a train record in metrics.jsonl and, where no terminal shows the progress bar, a progress line"})
    tensorboard: bool = field(default=True, metadata={"help": "also write the train, epoch and eval records as TensorBoard scalars into RUN/tensorboard (rank 0) (default: on where the tensorboard package is installed)"})
    checkpoints: bool = field(default=True, metadata={"help": "write checkpoint.pt (--no-checkpoints: nothing but the logs, no checkpoint and no kept copy; a restarted run then starts again from step 0)"})
    checkpoint_every: int = field(default=1, metadata={"help": "epochs between checkpoints (the end is always saved)"})
    checkpoint_every_steps: int = field(default=0, metadata={"help": "also checkpoint every N optimizer steps, written in the background (0: never)"})
    checkpoint_every_minutes: float = field(default=0.0, metadata={"help": "also checkpoint every M minutes of training (rank 0's clock, agreed by all ranks), written in the background (0: never)"})
    keep_checkpoints: int = field(default=0, metadata={"help": "besides checkpoint.pt (the latest), keep checkpoint-epochNNN.pt of the last N epochs and checkpoint-best.pt of the best top-1 evaluated (copies of the finished checkpoint.pt, read by a resume when checkpoint.pt cannot be; 0: only checkpoint.pt)"})
    commit_every: int = field(default=50, metadata={"help": "Horovod Elastic: commit the state to host memory every N steps (and at epoch ends); a lost worker costs the steps since"})
    resume: bool = field(default=False, metadata={"help": "continue the run in --out-dir from its checkpoint.pt (the same command does so by itself; --resume insists on a checkpoint and may change settings)"})
    init_from: str = field(default="", metadata={"metavar": "PATH", "help": "start a new run from these weights: another run's checkpoint, a torchvision ResNet state_dict file, or another script's checkpoint (weights under model, state_dict, ...; DDP's module. dropped); another class count keeps the new fc (fine-tuning)"})
    command_batch_size: int = field(default=0, metadata={"internal": True})  # set by parse: a restart's --batch-size, not taken
    restarted: bool = field(default=False, metadata={"internal": True})  # set by parse: the command found its own run (its config.yaml) in --out-dir
    show_recipe: bool = field(default=False, metadata={"help": "print the resolved settings and the per-epoch schedule (global batch, LR, augmentation) as JSON, and stop"})
    test_only: bool = field(default=False, metadata={"help": "evaluate --out-dir's checkpoint on the validation set of its data (or --data-dir) and print top-1/top-5; changes nothing in the run"})
    checkpoint: str = field(default="", metadata={"metavar": "PATH", "help": "--test-only evaluates this checkpoint: a file in --out-dir (checkpoint-best.pt, checkpoint-epoch010.pt: --keep-checkpoints) or a path (default: --out-dir's checkpoint.pt)"})
    max_bad_steps: int = field(default=20, metadata={"help": "stop after this many consecutive non-finite losses"})
    division: str = field(default="open", metadata={"help": "MLPerf division declared in the log (closed: MLPerf's rules on optimizer and schedule are checked)"})
    submission_org: str = field(default="reference-trainer", metadata={"help": "organisation named in the MLPerf log (submission_org)"})
    submission_platform: str = field(default="", metadata={"help": "platform named in the MLPerf log (default: <ranks>x<device name>)"})
    preset: str = field(default="", metadata={"help": "YAML preset name in train/presets or a path (default: smoke without --data-dir)"})


FIELDS = {f.name: f for f in fields(Config) if not f.metadata.get("internal")}

# --help's argument groups, by the task a user looks for a flag under; every flag is in one
# (tests/test_help.py checks)
GROUPS = {
    "data and loader": ("data_dir", "loader", "dali_decode", "workers", "image_size", "resolution_schedule", "crop_min_scale", "crop_max_scale",
                        "crop_min_aspect", "crop_max_aspect", "augment_off_epoch", "num_classes", "synthetic_images",
                        "synthetic_val_images", "synthetic_classes"),
    "model": ("arch", "zero_init_residual", "blurpool", "ema_decay", "init_from_seed"),
    "optimizer and schedule": ("optimizer", "batch_size", "global_batch_size", "batch_schedule", "epochs", "max_steps",
                               "lr", "lr_per_256", "lr_schedule", "warmup_epochs", "warmup_start_lr", "end_lr",
                               "lr_decay_power", "lr_decay_epochs", "lr_decay_factor", "lr_phases", "momentum",
                               "nesterov", "weight_decay", "label_smoothing", "lars_eta", "lars_epsilon",
                               "sgd_share_center", "sgd_share_width", "rmsprop_lr_ratio", "rmsprop_alpha",
                               "rmsprop_epsilon", "max_bad_steps"),
    "precision and speed": ("precision", "channels_last", "compile", "compile_mode", "lars_compile", "threads"),
    "distributed and all-reduce": ("engine", "allreduce", "ranks_per_node", "torus_rows", "fp16_allreduce",
                                   "stop_check_every", "commit_every"),
    "BatchNorm": ("bn_group_size", "bn_span", "bn_recompute_batches"),
    "checkpoints and resume": ("out_dir", "resume", "init_from", "checkpoints", "checkpoint_every",
                               "checkpoint_every_steps", "checkpoint_every_minutes", "keep_checkpoints"),
    "evaluation": ("eval_every", "eval_offset", "eval_image_size", "eval_flip", "target_accuracy", "test_only", "checkpoint"),
    "logging": ("log_every", "tensorboard", "division", "submission_org", "submission_platform"),
    "presets and recipes": ("preset", "seed", "show_recipe"),
}
PREEMPTED_MARKER = "PREEMPTED"  # written beside checkpoint.pt when a signal stopped the run


def to_dict(cfg: Config) -> dict:
    return {name: value for name, value in dataclasses.asdict(cfg).items() if name in FIELDS}
