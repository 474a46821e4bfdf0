"""Folders a process cannot write, both ways a user meets one: a read-only mount (EROFS, which binds
root too) and a folder without write permission (EACCES). Root ignores permissions through its
CAP_DAC_OVERRIDE capability, so under root the process that should meet EACCES runs without it
(setpriv drops it from the bounding set; the owner's mode bits then apply to root as to anyone)."""
import contextlib
import os
import shutil
import subprocess
from pathlib import Path

KINDS = ("read-only mount", "no write permission")


@contextlib.contextmanager
def read_only_mount(folder: Path):
    """`folder` remounted read-only in place (a bind mount over itself), unmounted on the way out
    whatever happened; skips the test where mounting is not allowed (not root, or no CAP_SYS_ADMIN)."""
    import pytest
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a read-only bind mount needs root")
    mounted = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount refused here: {mounted.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
        yield Path(folder)
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@contextlib.contextmanager
def without_write_permission(folder: Path):
    """Every folder under `folder` (itself included) enterable and readable, writable by nobody;
    the modes are given back on the way out."""
    folders = [Path(folder), *(p for p in Path(folder).rglob("*") if p.is_dir() and not p.is_symlink())]
    modes = [p.stat().st_mode for p in folders]
    for path in folders:
        path.chmod(0o555)
    try:
        yield Path(folder)
    finally:
        for path, mode in zip(folders, modes):
            path.chmod(mode)


def unwritable(kind: str, folder: Path):
    """`folder` made unwritable the `kind` way (one of KINDS), for the length of a with-block."""
    return read_only_mount(folder) if kind == "read-only mount" else without_write_permission(folder)


def as_unprivileged(command: list[str]) -> list[str]:
    """`command` run so that permissions apply to it: as it is for a user, without root's
    permission-bypassing capabilities under root."""
    if os.geteuid() != 0:
        return command
    import pytest
    if shutil.which("setpriv") is None:
        pytest.skip("running without CAP_DAC_OVERRIDE needs setpriv (util-linux)")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *command]
