"""The ways a run ends other than by finishing, and bad input. Every module that refuses something
imports its error from here; this module imports nothing of the project's, so it sits below them all.

train/__main__.py turns each into its exit code: UsageError 2 (data/'s DataError too), RunAborted 3,
Preempted 75 (EX_TEMPFAIL: a requeued job resumes), RunFinished 0.
"""


class UsageError(ValueError):
    """Bad input: the message names the problem and what to do; the CLI exits with code 2."""


class RunFinished(Exception):
    """The run in --out-dir has nothing left to do: said in one line, its files untouched, exit 0."""


class RunAborted(RuntimeError):
    """The run stopped itself cleanly (MLLOG status aborted) and kept its last good checkpoint."""


class Diverged(RunAborted):
    """The loss stayed non-finite."""


class Preempted(Exception):
    """SIGUSR1/SIGTERM/SIGINT arrived: the checkpoint is written (and rank 0 said so) and the next
    start resumes by itself."""


def raised_everywhere(err: Exception) -> Exception:
    """Marks an error that every rank raises alike, so that only rank 0 prints it."""
    err.raised_everywhere = True
    return err
