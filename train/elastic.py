"""Horovod Elastic: the epochs under `hvd.elastic.run`, so that a lost worker costs the steps since
the last commit, not the run (docs/elastic.md).

horovodrun --min-np M --max-np N --host-discovery-script S starts the workers with HOROVOD_ELASTIC=1.
Every --commit-every steps, and at each epoch's end, the state goes to host memory (a commit). When a
worker fails, the others' next collective raises HorovodInternalError: they roll back to the commit,
Horovod forms the new set of workers, and training goes on from there with the same global batch over
the new rank count. A worker that joins gets the state from the most advanced worker (a sync).

What the state holds: the model (weights and BatchNorm statistics), the optimizer, the loss scaler, and
the run's position (step, epoch, step in the epoch, the sample ledger). The sampler needs no state of
its own: it picks by global position in the epoch's order, so the position is the sampler's position
whatever the rank count.
"""
import contextlib
import dataclasses

from horovod.common.elastic import State

from data import LoaderSettings, build_loader
from train import checkpoint, runlock
from train.config import UsageError
from train.runlog import RunLog
from train.startup import agreed_error, check_batch_phases, resolve_data_dir


class TrainingState(State):
    """A run's state for Horovod Elastic: committed to host memory, restored after a failure, and
    synchronised from the most advanced worker when the workers change."""

    def __init__(self, training):
        self.training = training
        hvd = training.engine.hvd
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.committed = checkpoint.host_copy(training.state_dict(training.ledger.saved))  # no collective here

    def save(self) -> None:
        """A commit (every rank at the same step): the ledger's total needs one small all-reduce."""
        self.committed = checkpoint.host_copy(self.training.state_dict(self.training.ledger.total(self.training.engine)))

    def restore(self) -> None:
        # from a copy: on the CPU the optimizer keeps the tensors it loads, and training on would
        # change the commit that a second failure must go back to
        self.training.load_state_dict(checkpoint._replace(self.committed, lambda t: t.clone()))

    def sync(self) -> None:
        """Every worker takes the state of the one furthest on (a joining worker has at most the last
        checkpoint; after a failure all hold the same commit): weights as tensors, the rest as objects."""
        training, engine = self.training, self.training.engine
        steps = engine.hvd.allgather_object(training.state.step)
        root = steps.index(max(steps))
        engine._broadcast_tensors(engine.unwrap(training.model).state_dict(), root=root)
        rest = training.state_dict(training.ledger.saved)
        rest.pop("model")
        # in host memory: a pickled GPU tensor would be unpickled onto the root's device on every worker
        rest = checkpoint._replace(rest, lambda t: t.detach().cpu()) if engine.rank == root else None
        # (named: Horovod names it by the object's type otherwise, which differs between root and the rest)
        training.load_state_dict(engine.hvd.broadcast_object(rest, root_rank=root, name="elastic.state"), weights=False)
        self.committed = checkpoint.host_copy(training.state_dict(training.ledger.saved))

    def reset(self) -> None:
        """Horovod formed a new set of workers (hvd.init() again): take the new rank and count."""
        rejoin(self.training)


def rejoin(training) -> None:
    """The engine's new rank and count, the same global batch over them, a loader for this rank's
    share, and the run log with whoever is rank 0 now."""
    engine, cfg = training.engine, training.cfg
    old_rank = engine.rank
    engine.rejoin()
    if old_rank == 0 and engine.rank != 0:
        # its write in flight lands now, never after a newer one of the new rank 0 (the state sync, a
        # collective, waits for this); how it went is the new rank 0's to say no more
        with contextlib.suppress(OSError):
            training.writer.wait()
    try:  # every phase of --batch-schedule, not only this one: the count may not change again
        check_batch_phases(cfg, engine.world_size, training.loader.train_images)
    except UsageError as err:  # (every worker decides alike)
        raise agreed_error(UsageError(f"with {engine.world_size} workers now: {err}, or global batches that every "
                                      "count from --min-np to --max-np divides"))
    training.cfg = cfg = dataclasses.replace(cfg, batch_size=cfg.global_batch_size // engine.world_size)
    settings = LoaderSettings.of(cfg, data_dir=resolve_data_dir(cfg), precision=training.precision.name)
    training.loader.close()  # its reader threads or processes, before the new loader starts its own
    training.loader = build_loader(cfg.loader, settings, engine.rank, engine.world_size, engine.device)
    training.loader_batch = cfg.batch_size
    if engine.rank != old_rank and (engine.rank == 0 or old_rank == 0):
        # the run directory's lock goes with rank 0: the job keeps it across the change (train/runlock.py)
        if training.lock:
            training.lock.hand_over()
        training.lock = runlock.RunLock.acquire(training.out_dir, elastic=True) if engine.rank == 0 else None
        training.log.close()
        training.log = RunLog(training.out_dir if engine.rank == 0 else None, cfg, training.eval_plan)
        training.log.take_over(training.state.step)
    global_batch = training.schedule.global_batch(training.state.epoch)
    training.log.workers(training.state.step, engine.world_size, global_batch // engine.world_size)


def run_epochs(training, stop_signal) -> None:
    """training.run_epochs under hvd.elastic.run, committing every --commit-every steps."""
    import horovod.torch as hvd

    state = TrainingState(training)
    training.commit = state.commit

    @hvd.elastic.run
    def epochs(state):
        training.run_epochs(stop_signal)

    epochs(state)

