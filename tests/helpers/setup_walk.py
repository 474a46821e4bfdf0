"""The walk a reader takes following a run's settings from `run(cfg)` to the first training step: each
call from one file of the project into another that passes the settings (a Config, or an object
holding one as `.cfg`), in the order they are made. A call into a file the walk has been in before
is a re-entry (tests/test_layout.py bounds them); calls within a file, and the returns, are not steps.

`python tests/helpers/setup_walk.py` prints the walk of a tiny synthetic run and its re-entries.
"""
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = tuple(str(REPO / package) + "/" for package in ("train", "data", "models"))


def walk(cfg) -> list[str]:
    """Runs `cfg` (train.loop.run) and returns the walk as "file: function" steps; it ends where the
    first epoch starts."""
    from train.config import Config
    from train.loop import run

    files: list[str] = ["train/loop.py: run"]

    class FirstEpoch(Exception):
        pass

    def carries_settings(value) -> bool:
        return isinstance(value, Config) or isinstance(getattr(value, "cfg", None), Config)

    def ours(frame):
        while frame is not None and not frame.f_code.co_filename.startswith(OURS):
            frame = frame.f_back
        return frame

    def follow(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(OURS):
            return
        if frame.f_code.co_name in ("train_epoch", "run_epochs"):
            raise FirstEpoch
        code, caller = frame.f_code, ours(frame.f_back)
        if caller is None or caller.f_code.co_filename == code.co_filename:
            return
        arguments = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]]
        if any(carries_settings(value) for value in arguments):
            name = str(Path(code.co_filename).relative_to(REPO))
            files.append(f"{name}: {code.co_name}")

    sys.setprofile(follow)
    try:
        run(cfg)
    except FirstEpoch:
        pass
    finally:
        sys.setprofile(None)
    return files


def reentries(files: list[str]) -> list[int]:
    """The positions in the walk where it comes back to a file it had left."""
    names = [step.split(":")[0] for step in files]
    return [i for i, name in enumerate(names) if name in names[:i]]


def tiny_run(out_dir: str):
    from train.config import Config
    return Config(loader="synthetic", arch="resnet18", image_size=16, synthetic_images=16, synthetic_val_images=8,
                  synthetic_classes=4, batch_size=8, epochs=1, eval_every=0, out_dir=out_dir, workers=0)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        files = walk(tiny_run(str(Path(folder) / "run")))
    again = set(reentries(files))
    for i, name in enumerate(files):
        print(f"{'  again' if i in again else '       '} {name}")
    print(f"re-entries: {len(again)}")
