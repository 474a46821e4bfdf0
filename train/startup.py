"""Start-up: every check that can fail and everything the run is defined by, resolved on every rank
before the run directory exists, and handed to the loop as one object (`prepare` -> `Setup`).

A failure on any rank is raised on every rank (`on_every_rank`), so no rank goes on alone and none
waits for one that stopped; such an error is marked `raised_everywhere` and printed once, by rank 0.
"""
import dataclasses
import os
import time
from pathlib import Path

import torch

from data import DataError, LoaderSettings, build_loader
from data.embedded import ensure_embedded
from models import build_model, first_misfit
from train import checkpoint, engines, runlock
from train.batches import accumulates, phase_split, split_batch
from train.compiled import GRAPH_MODES
from train.config import Config, ResolvedConfig, to_dict
from train.device_choices import choose_loader
from train.engines.topology import check_bn_span
from train.errors import RunFinished, UsageError, raised_everywhere
from train.precision import Precision, check_crop
from train.rules import DEFAULT_PER_RANK_BATCH, lr_and_warmup
from train.rundir import RunDir, Start, current_keys, start_of
from train.crops import crop_note, training_crops
from train.schedule import EpochClock, batch_changes, batch_phases


@dataclasses.dataclass
class Setup:
    """What start-up resolved, alike on every rank: the loop reads it and never calls back here.
    `reshare` is the part that depends on the rank count, made again when Horovod Elastic changes it."""
    cfg: ResolvedConfig  # the settings resolved for the device, the rank count and the data
    engine: "engines.Engine"
    precision: Precision
    loader: object  # this rank's share of the data (data.Loader)
    data_dir: str  # "" for synthetic data
    notes: dict  # for the header: how the LR and warmup ("lr") and the per-GPU batch ("batch") were chosen, the crops ("crops")
    run_dir: RunDir  # the run directory: its files, what it holds
    lock: "runlock.RunLock | None"  # rank 0's lock on the run directory (it moves with rank 0: train/elastic.py)
    start: Start  # new, restart or resume, and what the command line took from the run it found
    init: "tuple[dict, str] | None"  # --init-from's checked weights and the line that says where the run starts
    restart_flags: str  # what a restart must add to the command to find a time-stamped run directory again
    started_ms: int  # when start-up began (MLLOG's init_start)
    warnings: list = dataclasses.field(default_factory=list)  # for the run's log, once it exists

    def reshare(self) -> None:
        """After the engine's rank count changed: every phase of --batch-schedule checked against the
        new count (the count may not change again), the per-rank batch, and a loader for this rank's
        share. A refusal leaves the old share in place."""
        cfg, world_size = self.cfg, self.engine.world_size
        # the per-rank batch kept where the new count divides the global batch, with other accumulation steps
        kept = dataclasses.replace(self.start, saved_batch=(cfg.batch_size, cfg.accumulation_steps))
        batch, _, steps, _, _ = split_batch(cfg, self.engine, self.precision.name,
                                            training_crops(cfg.image_size, cfg.resolution_schedule)[1], kept)
        shared = dataclasses.replace(cfg, batch_size=batch, accumulation_steps=steps)  # (resolved again)
        check_batch_phases(shared, world_size, self.loader.train_images)
        self.cfg = shared
        self.loader.close()  # its reader threads or processes, before the new loader starts its own
        self.loader = _build_loader(self.cfg, self.engine, self.precision, self.data_dir)


def prepare(cfg: Config, start: Start | None = None) -> Setup:
    """The engine, the settings resolved for its rank count, the checks of the input, then the run
    directory (rank 0 makes it and takes its lock). `start`: cli.read_command's decision on the run
    directory (None: decided here from the settings and the directory, as the command line would)."""
    started_ms = int(time.time() * 1000)
    start = start or start_of(cfg)
    engine = create_engine(cfg)
    # one name, whatever each rank's clock says (Horovod Elastic has no collective for it: make_out_dir refuses)
    out_dir = cfg.out_dir or ("" if engine.elastic else engine.broadcast_object(_default_out_dir(cfg)))
    run, loader, precision, data_dir, notes, init, warnings = on_every_rank(
        engine, lambda: checked_setup(cfg, engine, out_dir, start))
    if hasattr(engine, "cfg"):  # (the distributed engines' settings: resolved from here on, for DDP's static_graph)
        engine.cfg = run
    loader, relisted = same_sample_lists(engine, run, precision, data_dir, loader)
    run_dir, lock = on_every_rank(engine, lambda: make_out_dir(run, engine, start))
    return Setup(cfg=run, engine=engine, precision=precision,
                 loader=loader, data_dir=data_dir, notes=notes, run_dir=run_dir, lock=lock, start=start,
                 init=init,
                 restart_flags="" if cfg.out_dir else f" with --out-dir {run_dir.path}", started_ms=started_ms,
                 warnings=warnings + ([relisted] if relisted else []))


def same_sample_lists(engine, cfg: ResolvedConfig, precision: Precision, data_dir: str, loader) -> tuple:
    """(loader, warning or ""): every rank trains on the same sample list. Each rank reads its list
    from an index (data/index.py), and a node's own cache may hold one that passes the index's check
    but lists other files; so the ranks compare digests of their lists, and when any differs from rank
    0's, every rank lists the folders again, trusting no index. Lists that still differ mean the nodes
    see different data: refused on every rank. (Horovod Elastic: no collective before its state sync;
    each rank keeps its own list.)"""
    if engine.elastic or engine.world_size == 1:
        return loader, ""
    digests = engine.gather_object(loader.sample_list_digest)
    if len(set(digests)) == 1:
        return loader, ""
    differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]

    def relisted():
        loader.close()
        return _build_loader(cfg, engine, precision, data_dir, relist=True)
    loader = on_every_rank(engine, relisted)
    again = engine.gather_object(loader.sample_list_digest)
    hosts = engine.hosts or ["?"] * engine.world_size
    where = ", ".join(f"{rank} on {hosts[rank]}" for rank in differing)
    if len(set(again)) > 1:
        still = ", ".join(f"{rank} on {hosts[rank]}" for rank, digest in enumerate(again) if digest != again[0])
        raise raised_everywhere(UsageError(f"the ranks see different images in {data_dir}: rank(s) {still} list other "
                                      f"files than rank 0 on {hosts[0]}; give every node the same data folder"))
    return loader, (f"rank(s) {where} read another sample list of {data_dir} than rank 0 (a stale index in a "
                    "node's cache); every rank listed the folders again, and now they agree")


def prepare_evaluation(cfg: Config, start: Start | None = None) -> tuple:
    """--test-only's start-up: (engine, precision, loader, saved state) for the checkpoint in --out-dir
    (or --test-checkpoint) over the validation set of its run's data (or --data-dir)."""
    engine = create_engine(cfg)
    run_dir = run_dir_of(start, cfg.out_dir)

    def checked():
        saved = run_dir.to_evaluate(cfg.test_checkpoint)
        precision = Precision(cfg.precision, engine.device)
        batch = cfg.batch_size or cfg.global_batch_size // engine.world_size or DEFAULT_PER_RANK_BATCH  # the run's per-rank batch
        data_dir = resolve_data_dir(cfg)
        settings = LoaderSettings.of(cfg, data_dir=data_dir, batch_size=batch, evaluate_only=True,
                                     precision=precision.name)
        name, _ = choose_loader(cfg.loader, cfg.dali_decode, engine.device)
        loader = build_loader(name, settings, engine.rank, engine.world_size, engine.device)
        if not loader.val_images:
            raise UsageError("--test-only needs validation images, and --synthetic-val-images is 0; give more")
        state = checkpoint.load(saved, engine.device)
        check_evaluated(state, cfg, loader, saved, data_dir)
        return precision, loader, state
    return (engine, *on_every_rank(engine, checked))


def create_engine(cfg: Config):
    # TRAINER_IFACE, before any library starts: a host may lack it while others have it, so the error
    # is this rank's own (printed by every rank that meets it)
    try:
        engines.use_interface()
    except UsageError as err:
        engines.tell_refusal(f"{err}")  # torchrun: the other nodes' ranks would wait for this one
        raise
    try:
        engine = engines.create(cfg)
    except UsageError as err:  # decided by the flags and the launcher's environment: alike on every rank
        raise raised_everywhere(err)
    engine.threads = compute_threads(cfg, getattr(engine, "on_this_host", 1), engine.device.type == "cuda")
    torch.set_num_threads(engine.threads)
    return engine


def compute_threads(cfg: Config, ranks_here: int, on_gpu: bool, env=os.environ) -> int:
    """Compute threads per rank: --threads, else OMP_NUM_THREADS, else the cores this process may use
    shared by the ranks on its host, less the loader's --workers on a GPU run (they decode all along to
    keep the GPU fed; on a CPU run they idle most of the time: training is far slower than decoding),
    at least 1. More threads than cores cost more than they give (docs/threads.md has the figures)."""
    if cfg.threads:
        return cfg.threads
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    input_threads = cfg.workers if on_gpu and cfg.loader != "synthetic" else 0
    return max(1, cores // max(1, ranks_here) - input_threads)


def on_every_rank(engine, step):
    """Runs a set-up step on every rank; if it fails on any, every rank raises the first failure
    (rank 0 prints it), so no rank goes on alone and no rank hangs waiting for one that stopped.
    Under Horovod Elastic each rank decides alone: a worker joining a running job must not issue a
    collective before the state sync (the others would wait in theirs); the checks read the same
    flags and files on every rank, so they fail alike."""
    if engine.elastic:
        return step()
    try:
        value, problem = step(), None
    except (UsageError, DataError, RunFinished) as err:
        value, problem = None, (type(err).__name__, str(err))
    first = next((p for p in engine.gather_object(problem) if p is not None), None)
    if first is not None:
        kind = {cls.__name__: cls for cls in (UsageError, DataError, RunFinished)}[first[0]]
        raise raised_everywhere(kind(first[1]))
    return value


def checked_setup(cfg: Config, engine, out_dir: str, start: Start | None = None):
    """The settings resolved and the parts that check the input: (the ResolvedConfig, loader, precision, data dir,
    the header's notes, --init-from's weights and line or None, warning lines). What the flags leave
    open the device decides (train/device_choices.py): the precision, the loader and the per-GPU batch."""
    start = start or start_of(cfg)
    smallest_crop, largest_crop = training_crops(cfg.image_size, cfg.resolution_schedule)
    precision = Precision(cfg.precision, engine.device)
    check_crop(precision.name, engine.device, smallest_crop)
    loader_name, loader_warning = choose_loader(cfg.loader, cfg.dali_decode, engine.device)
    if start.restarted and cfg.global_batch_size % engine.world_size:
        raise UsageError(f"{cfg.out_dir} holds a run of global batch {cfg.global_batch_size}, which does not divide "
                         f"over {engine.world_size} ranks; continue it on a rank count that divides it")
    batch_size, global_batch, steps, largest, batch_note = split_batch(cfg, engine, precision.name, largest_crop, start)
    lr, warmup, note = lr_and_warmup(cfg, global_batch)
    check_bn_span(cfg.bn_span, engine.world_size)
    data_dir = resolve_data_dir(cfg)
    loader = build_loader(loader_name, LoaderSettings.of(cfg, data_dir=data_dir, batch_size=batch_size,
                                                       accumulation_steps=steps, precision=precision.name),
                          engine.rank, engine.world_size, engine.device)
    if cfg.num_classes and cfg.num_classes != loader.num_classes:  # a resumed run's model has the recorded count
        raise UsageError(f"{data_dir or 'the synthetic data'} has {loader.num_classes} classes, the run "
                         f"{cfg.num_classes}; check --data-dir (or --num-classes)")
    run = resolved(cfg, loader=loader_name, batch_size=batch_size, global_batch_size=global_batch, lr=lr,
                   warmup_epochs=warmup, num_classes=loader.num_classes, out_dir=out_dir,
                   eval_every=cfg.eval_every if loader.val_images else 0,  # (--synthetic-val-images 0: nothing to evaluate)
                   resume=start.from_checkpoint,
                   accumulation_steps=steps, largest_batch=largest,
                   bn_ghost_group=ghost_group(cfg, global_batch, engine.world_size, steps, largest))
    check_batch_phases(run, engine.world_size, loader.train_images)
    if run.compile and run.compile_mode in GRAPH_MODES and accumulates(run):
        raise UsageError(f"--compile-mode {run.compile_mode} replays CUDA graphs, which overwrite one pass's gradients "
                         "with the next's when batches accumulate; use --compile-mode default or one batch per step")
    init = init_weights(run) if run.init_from and not run.resume else None  # loaded into the model by the loop
    # read-only checks of the run directory the user named: rank 0's verdict reaches the others through
    # on_every_rank(); under Horovod Elastic (no collective there) every rank reads the same files and decides alike
    if cfg.out_dir and (engine.rank == 0 or engine.elastic):
        run_dir = run_dir_of(start, run.out_dir)
        run_dir.check(run, start, elastic=engine.elastic)
        if run.resume:
            _check_resume_position(run, loader, run_dir)
    warnings = [line for line in (engine.warning, precision.warning, loader_warning) if line]
    if engine.name == "torch" and run.ddp_static_graph == "on" and accumulates(run):
        warnings.append("--ddp-static-graph on not taken: DDP's static graph cannot be combined with the passes whose "
                        "gradients accumulate (docs/accumulation.md)")
    notes = {"lr": note, "batch": batch_note, "crops": crop_note(cfg)}
    return run, loader, precision, data_dir, notes, init, warnings


def resolved(cfg: Config, **chosen) -> ResolvedConfig:
    """The Config as typed with the values start-up chose."""
    return ResolvedConfig(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, **chosen})


def _build_loader(cfg: ResolvedConfig, engine, precision: Precision, data_dir: str, relist: bool = False):
    return build_loader(cfg.loader, LoaderSettings.of(cfg, data_dir=data_dir, precision=precision.name, relist=relist),
                        engine.rank, engine.world_size, engine.device)


def check_evaluated(state: dict, cfg: Config, loader, saved: Path, data_dir: str) -> None:
    """The checkpoint fits the model --arch builds, and the data's classes are the run's, name by name
    (the same count with other names would be scored as if they were the run's)."""
    weights, data = state["model"], data_dir or "the synthetic data"
    if weights["fc.weight"].shape[0] != loader.num_classes:
        raise UsageError(f"{saved} has {weights['fc.weight'].shape[0]} classes, the "
                         f"data {data} {loader.num_classes}; check --data-dir")
    saved_arch = current_keys(state.get("config", {})).get("arch", "?")
    differing = first_misfit(weights, cfg.arch, loader.num_classes)
    if differing:
        raise UsageError(f"{saved} holds a {saved_arch}, which --arch {cfg.arch} does not build "
                         f"({differing} differs); drop --arch or give the run's")
    recorded = state.get("classes")
    if recorded and loader.class_names and recorded != loader.class_names:
        first = next(i for i, (a, b) in enumerate(zip(recorded, loader.class_names)) if a != b)
        raise UsageError(f"the classes of {data} are not the run's (class {first} is {loader.class_names[first]!r} "
                         f"there, {recorded[first]!r} in the run); check --data-dir")


HEAD = ("fc.weight", "fc.bias")  # the classifier, the one part that depends on the class count


def init_weights(cfg: Config) -> tuple[dict, str]:
    """--init-from's weights (plain data only), checked against this run's model tensor by tensor, and
    the line that says where the run starts. Weights for another class count are fine-tuning's start:
    all but the classifier head load, the head stays as this run's model was built (as timm does for a
    changed class count); any other difference is refused."""
    path = Path(cfg.init_from)
    weights, found = checkpoint.load_weights(path, "check --init-from")
    with torch.device("meta"):  # shapes only, nothing allocated
        expected = build_model(cfg.arch, cfg.num_classes, cfg.zero_init_residual, cfg.channels_last, cfg.blurpool).state_dict()
    where = f"this run's {cfg.arch} with {cfg.num_classes} classes"
    for name, tensor in expected.items():
        if name not in weights:
            raise UsageError(f"--init-from {path} has no {name}, which {where} needs; give weights of the same --arch")
        shape = weights[name].shape
        if shape != tensor.shape and not (name in HEAD and shape[1:] == tensor.shape[1:]):
            raise UsageError(f"--init-from {path}: {name} is {list(shape)} there, {list(tensor.shape)} in "
                             f"{where}; give weights of the same --arch")
    extra = next((name for name in weights if name not in expected), None)
    if extra:
        raise UsageError(f"--init-from {path} holds {extra}, which {where} does not have; give weights of the same --arch")
    start_line = f"starting from the weights in {path}" + (f" ({', '.join(found)})" if found else "")
    if any(weights[name].shape != expected[name].shape for name in HEAD):
        start_line += f"; fc.* left new: {weights['fc.weight'].shape[0]} classes there, {cfg.num_classes} here"
        weights = {name: tensor for name, tensor in weights.items() if name not in HEAD}
    return weights, start_line


def _check_resume_position(cfg: Config, loader, run_dir: RunDir) -> None:
    """The saved step must sit where these batch settings put it: resuming with another global batch
    or --batch-schedule would train the epoch's images twice or never, or never end the epoch. And the
    data's classes must be the run's, name by name."""
    saved = run_dir.saved_position()
    if saved.get("classes") and loader.class_names and saved["classes"] != loader.class_names:
        raise UsageError(f"the classes of {cfg.data_dir or 'the data'} are not those of the run in {cfg.out_dir} "
                         "(same count, other names); check --data-dir")
    clock = EpochClock.of(cfg, loader.train_images)
    epoch, in_epoch = saved["epoch"], saved["step_in_epoch"]
    if epoch < cfg.epochs and (saved["step"] != clock.first_step(epoch) + in_epoch or in_epoch > clock.steps_in(epoch)):
        raise UsageError(f"{cfg.out_dir} stopped at step {saved['step']} (step {in_epoch} of epoch {epoch + 1}), which "
                         "these batch settings do not reach that way; resume with the run's own --global-batch-size "
                         "and --batch-schedule")


def check_batch_phases(cfg: ResolvedConfig, world_size: int, train_images: int) -> None:
    """Every global batch of --batch-schedule divides over the ranks, fits in the training set, and
    splits into whole --bn-group-size groups."""
    for _, batch in batch_phases(cfg):
        if batch % world_size:
            raise UsageError(f"--batch-schedule's global batch {batch} does not divide over {world_size} ranks; "
                             "choose multiples of the rank count")
        if batch > train_images:
            raise UsageError(f"global batch {batch} is more than the {train_images} training images; lower it")
        per_rank, _ = phase_split(batch, world_size, cfg.accumulation_steps or 1, cfg.largest_batch or batch)
        if cfg.bn_group_size and cfg.bn_group_size < per_rank and per_rank % cfg.bn_group_size:
            raise UsageError(f"--bn-group-size {cfg.bn_group_size} does not divide the per-rank batch {per_rank}; "
                             "choose a divisor")


def ghost_group(cfg: Config, global_batch: int, world_size: int, steps: int = 1, largest: int = 0) -> int:
    """--bn-group-size when it splits some phase's per-rank batch into groups, else 0: BN over the
    whole per-rank batch is then plain BatchNorm, bit for bit."""
    phases = [global_batch, *(batch for _, batch in batch_changes(cfg.batch_schedule))]
    biggest = max(phase_split(batch, world_size, steps, largest or batch)[0] for batch in phases)
    return cfg.bn_group_size if 0 < cfg.bn_group_size < biggest else 0


def resolve_data_dir(cfg: Config) -> str:
    """--data-dir, or the embedded dataset (made on first use) when none is given; "" for synthetic data."""
    return cfg.data_dir or (str(ensure_embedded()) if cfg.loader != "synthetic" else "")


def _default_out_dir(cfg: Config) -> str:
    return cfg.out_dir or f"runs/{Path(cfg.preset).stem or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_dir_of(start: "Start | None", out_dir: str) -> RunDir:
    """The Start's RunDir (its saved settings read once) when it names `out_dir`, else a RunDir of it."""
    if start and start.run_dir and start.run_dir.path == Path(out_dir):
        return start.run_dir
    return RunDir(out_dir)


def make_out_dir(cfg: ResolvedConfig, engine, start: Start) -> tuple[RunDir, "runlock.RunLock | None"]:
    """Rank 0 makes the run directory (RunDir.make: its lock, config.yaml); every rank learns the name."""
    if engine.elastic and not cfg.out_dir:  # (no collective to agree on a time-stamped name; see on_every_rank())
        raise UsageError("Horovod Elastic needs --out-dir: a worker that joins later must find the run's directory")
    run_dir = run_dir_of(start, cfg.out_dir)
    if engine.rank != 0:
        return run_dir, None
    return run_dir, run_dir.make(to_dict(cfg), start, elastic=engine.elastic)
