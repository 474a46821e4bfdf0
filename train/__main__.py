"""`python -m train [flags]`: see `python -m train --help`.

torch and the modules that need it are imported once the flags are read, so that --help and a refused
flag answer at once."""
import sys

from data.tree import DataError
from train.cli import read_command
from train.errors import Preempted, RunAborted, RunFinished, UsageError


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            cfg, start = read_command(sys.argv[1:] if argv is None else argv)
        except UsageError as err:  # the same flags on every rank: the same error everywhere
            err.raised_everywhere = True
            raise
        if cfg.show_recipe:
            from train.recipe import show_recipe
            show_recipe(cfg)
        elif cfg.test_only:
            from train.evaluate import test_only
            test_only(cfg, start)
        else:
            from train.loop import run
            run(cfg, start=start)
    except (UsageError, DataError) as err:
        return _exit(err, f"error: {err}", 2)
    except RunAborted as err:
        return _exit(err, f"error: {err}", 3)
    except Preempted:  # rank 0 has said so before any rank left
        return 75  # EX_TEMPFAIL: try again (a requeued job resumes)
    except RunFinished as err:
        if _rank() == 0:
            print(err, flush=True)
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C, or one during set-up: stop now, no checkpoint
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _exit(err: Exception, message: str, code: int) -> int:
    """Every rank exits with the code. A failure raised on every rank alike (marked `raised_everywhere`) is printed
    once, by rank 0; any other is printed by the rank that met it."""
    if _rank() == 0 or not getattr(err, "raised_everywhere", False):
        print(message, file=sys.stderr)
    return code



def _rank() -> int:
    from train.engines import detect_launch
    return detect_launch().rank


if __name__ == "__main__":
    sys.exit(main())
