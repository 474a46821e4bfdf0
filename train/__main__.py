"""`python -m train [flags]`: see `python -m train --help`."""
import sys

from data import DataError
from train.config import UsageError, parse
from train.loop import Preempted, RunAborted, run


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse(sys.argv[1:] if argv is None else argv))
    except (UsageError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Preempted as err:
        print(err, file=sys.stderr)
        return 75  # EX_TEMPFAIL: try again (a requeued job resumes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
