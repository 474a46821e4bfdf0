"""Every command's --help (python -m train, train.plan, train.score, train.predict, train.export and
train.bench with its modes): each flag described, in an argument group by task, its default said at
most once; and the help printed without loading torch (or the other heavy packages)."""
import argparse
import re
import subprocess
import sys

import pytest

from helpers import REPO, child_env
from train import bench, cli, export, predict
from train.plan import cli as plan_cli
from train.score import cli as score_cli

PARSERS = {"train": cli.parser, "train.plan": plan_cli.parser, "train.score": score_cli.parser,
           "train.predict": predict.parser, "train.export": export.parser, "train.bench": bench.parser}
HEAVY = ("torch", "torchvision", "onnx", "onnxruntime", "matplotlib")
DEFAULT_SAID = re.compile(r"\bdefault\b(?=:| \d| is\b)", re.IGNORECASE)  # "(default: X)", "(default 5)", "default is"


def with_modes(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parser and, for a command with modes (subcommands), each mode's parser, and theirs."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for mode in action.choices.values():
                found += with_modes(mode)
    return found


def problems(parser: argparse.ArgumentParser) -> list[str]:
    """What each action other than -h/--help lacks: a help, a titled group other than argparse's
    default one for options, a default said at most once."""
    found = [] if parser.usage else [f"{parser.prog}: no short usage line"]
    group_of = {id(action): group for group in parser._action_groups for action in group._group_actions}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = f"{parser.prog} {'/'.join(action.option_strings) or action.metavar or action.dest}"
        if isinstance(action, argparse._SubParsersAction):
            found += [f"{name} {mode.dest}: no help" for mode in action._choices_actions if not (mode.help or "").strip()]
            continue
        shown = parser._get_formatter()._expand_help(action) if action.help else ""  # (%(default)s filled in)
        if not shown.strip():
            found.append(f"{name}: no help")
        if len(DEFAULT_SAID.findall(shown)) > 1:  # (not "the trainer's defaults", nor a choice named default)
            found.append(f"{name}: says its default more than once: {shown!r}")
        group = group_of.get(id(action))
        if action.option_strings and (group is None or group is parser._optionals or not group.title):
            found.append(f"{name}: in argparse's default group of options, not a group of its own task")
    return found


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_is_described_in_a_group_by_task_with_its_default_said_once(command):
    parsers = with_modes(PARSERS[command]())
    assert len(parsers) == (3 if command == "train.bench" else 1)
    assert [problem for parser in parsers for problem in problems(parser)] == []


def test_the_checks_see_a_missing_help_a_flag_left_in_the_default_group_and_a_default_said_twice():
    parser = argparse.ArgumentParser(prog="probe", usage="probe [OPTIONS]")
    parser.add_argument("--bare")
    task = parser.add_argument_group("a task")
    task.add_argument("--twice", default=3, help="n (default: 3) (default: %(default)s)")
    task.add_argument("--once", default="default", help="one of default, fast; the trainer's defaults (default 3)")
    assert problems(parser) == ["probe --bare: no help", "probe --bare: in argparse's default group of options, not "
                                "a group of its own task", "probe --twice: says its default more than once: "
                                "'n (default: 3) (default: 3)'"]


@pytest.mark.parametrize("argv", [["train"], ["train.plan"], ["train.score"], ["train.predict"], ["train.export"],
                                  ["train.bench"], ["train.bench", "train"], ["train.bench", "infer"]],
                         ids=" ".join)
def test_help_prints_without_loading_torch(argv):
    module, *mode = argv
    code = (f"import runpy, sys\nsys.argv = ['x', *{mode!r}, '--help']\n"
            f"try:\n    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
            "except SystemExit as done:\n    assert done.code in (0, None), done.code\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m " + " ".join(argv) in result.stdout, result.stdout
    assert result.stdout.splitlines()[-1] == "[]", f"--help loaded {result.stdout.splitlines()[-1]}"
