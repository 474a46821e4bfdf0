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

from horovod.common.elastic import State

from train.batches import epoch_split
from train.errors import UsageError, raised_everywhere
from train.host_memory import host_copy, replace_tensors


class TrainingState(State):
    """A run's state for Horovod Elastic, as its checkpoints hold it (train/saving.py's Checkpoints):
    committed to host memory, restored after a failure, and synchronised from the most advanced
    worker when the workers change."""

    def __init__(self, checkpoints, engine):
        self.checkpoints, self.engine = checkpoints, engine
        super().__init__(bcast_object=engine.hvd.broadcast_object, get_rank=engine.hvd.rank)
        self.committed = host_copy(checkpoints.state_dict())  # (the ledger's last sum: no collective here)

    def save(self) -> None:
        """A commit (every rank at the same step): the ledger's sum needs one small all-reduce."""
        self.committed = host_copy(self.checkpoints.state_dict(self.checkpoints.samples_total()))

    def restore(self) -> None:
        # from a copy: on the CPU the optimizer keeps the tensors it loads, and training on would
        # change the commit that a second failure must go back to
        self.checkpoints.load_state_dict(replace_tensors(self.committed, lambda t: t.clone()))

    def sync(self) -> None:
        """Every worker takes the state of the one furthest on (a joining worker has at most the last
        checkpoint; after a failure all hold the same commit): weights as tensors, the rest as objects."""
        checkpoints, engine = self.checkpoints, self.engine
        held = checkpoints.state_dict()  # (live tensors: the broadcast writes the root's weights into the model)
        steps = engine.hvd.allgather_object(held["step"])
        root = steps.index(max(steps))
        engine.broadcast_tensors(held.pop("model"), root=root)
        # in host memory: a pickled GPU tensor would be unpickled onto the root's device on every worker
        rest = replace_tensors(held, lambda t: t.detach().cpu()) if engine.rank == root else None
        # (named: Horovod names it by the object's type otherwise, which differs between root and the rest)
        checkpoints.load_state_dict(engine.hvd.broadcast_object(rest, root_rank=root, name="elastic.state"), weights=False)
        self.committed = host_copy(checkpoints.state_dict())


def rejoin(training) -> None:
    """The engine's new rank and count, then start-up's rank share again (train/startup.py,
    Setup.reshare: the same global batch over the new count, a loader for this rank's share), and the
    run directory's lock and the run log with whoever is rank 0 now."""
    engine, setup = training.engine, training.setup
    old_rank = engine.rank
    engine.rejoin()
    if old_rank == 0 and engine.rank != 0:
        # its write in flight lands now, never after a newer one of the new rank 0 (the state sync, a
        # collective, waits for this); how it went is the new rank 0's to say no more
        with contextlib.suppress(OSError):
            training.writer.wait()
    try:
        setup.reshare()
    except UsageError as err:  # (every worker decides alike)
        raise raised_everywhere(UsageError(f"with {engine.world_size} workers now: {err}, or global batches that "
                                           "every count from --min-np to --max-np divides"))
    if engine.rank != old_rank and (engine.rank == 0 or old_rank == 0):
        # the run directory's lock goes with rank 0: the job keeps it across the change (train/runlock.py)
        if setup.lock:
            setup.lock.hand_over()
        setup.lock = setup.run_dir.take_lock(elastic=True) if engine.rank == 0 else None
        training.reopen_log()
    _, per_rank, steps = epoch_split(setup.cfg, training.state.epoch)
    training.log.workers(training.state.step, engine.world_size, per_rank, steps)


def run_epochs(training, stop_signal) -> None:
    """training.run_epochs under hvd.elastic.run, which the loop commits every --commit-every steps;
    when Horovod formed a new set of workers (hvd.init() again), the training rejoins them."""
    import horovod.torch as hvd

    state = TrainingState(training.checkpoints, training.engine)
    state.register_reset_callbacks([lambda: rejoin(training)])

    @hvd.elastic.run
    def epochs(state):
        training.run_epochs(stop_signal, commit=state.commit)

    epochs(state)
