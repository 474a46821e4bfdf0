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

from train import runlock
from train.batches import epoch_split
from train.errors import UsageError, raised_everywhere
from train.host_memory import host_copy, replace_tensors


class TrainingState(State):
    """A run's state for Horovod Elastic: committed to host memory, restored after a failure, and
    synchronised from the most advanced worker when the workers change."""

    def __init__(self, training):
        self.training = training
        hvd = training.engine.hvd
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
        self.committed = host_copy(training.state_dict(training.samples_trained.saved))  # no collective here

    def save(self) -> None:
        """A commit (every rank at the same step): the ledger's total needs one small all-reduce."""
        self.committed = host_copy(self.training.state_dict(self.training.samples_trained.total(self.training.engine)))

    def restore(self) -> None:
        # from a copy: on the CPU the optimizer keeps the tensors it loads, and training on would
        # change the commit that a second failure must go back to
        self.training.load_state_dict(replace_tensors(self.committed, lambda t: t.clone()))

    def sync(self) -> None:
        """Every worker takes the state of the one furthest on (a joining worker has at most the last
        checkpoint; after a failure all hold the same commit): weights as tensors, the rest as objects."""
        training, engine = self.training, self.training.engine
        steps = engine.hvd.allgather_object(training.state.step)
        root = steps.index(max(steps))
        engine.broadcast_tensors(engine.unwrap(training.model).state_dict(), root=root)
        rest = training.state_dict(training.samples_trained.saved)
        rest.pop("model")
        # in host memory: a pickled GPU tensor would be unpickled onto the root's device on every worker
        rest = replace_tensors(rest, lambda t: t.detach().cpu()) if engine.rank == root else None
        # (named: Horovod names it by the object's type otherwise, which differs between root and the rest)
        training.load_state_dict(engine.hvd.broadcast_object(rest, root_rank=root, name="elastic.state"), weights=False)
        self.committed = host_copy(training.state_dict(training.samples_trained.saved))

    def reset(self) -> None:
        """Horovod formed a new set of workers (hvd.init() again): take the new rank and count."""
        rejoin(self.training)


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
    training.take_new_share()
    if engine.rank != old_rank and (engine.rank == 0 or old_rank == 0):
        # the run directory's lock goes with rank 0: the job keeps it across the change (train/runlock.py)
        if setup.lock:
            setup.lock.hand_over()
        setup.lock = runlock.RunLock.acquire(training.out_dir, elastic=True) if engine.rank == 0 else None
        training.reopen_log()
    _, per_rank, steps = epoch_split(setup.cfg, training.state.epoch)
    training.log.workers(training.state.step, engine.world_size, per_rank, steps)


def run_epochs(training, stop_signal) -> None:
    """training.run_epochs under hvd.elastic.run, committing every --commit-every steps."""
    import horovod.torch as hvd

    state = TrainingState(training)
    training.commit = state.commit

    @hvd.elastic.run
    def epochs(state):
        training.run_epochs(stop_signal)

    epochs(state)

