"""The parser every command of the project builds on (train, plan, score, predict, export, bench):
a refused flag is one line and exit 2, like every other bad input, and the help keeps names whole.
Light: a command's --help loads nothing more than argparse."""
import argparse
import re
import textwrap

from train.errors import UsageError


class CommandParser(argparse.ArgumentParser):
    """The parser of each of the project's commands (train, plan, score, predict, export, bench): a
    refused flag is one line and exit 2 like every other bad input (a UsageError naming the command's
    --help), not argparse's usage block; the help is laid out by HelpFormatter. A value that starts
    with '-' and a digit (--resolution-schedule -8:32:0:1, --lr-phases -1:2) is the value of the flag
    before it, whose own check then says what is wrong with it (argparse alone takes only a plain
    negative number so, and anything else for a flag: "expected one argument")."""

    def __init__(self, **settings):
        super().__init__(**{"formatter_class": HelpFormatter, **settings})
        self._negative_number_matcher = re.compile(r"^-\.?\d")  # (no flag of ours starts so)

    def error(self, message):
        raise UsageError(f"{message}; see {self.prog} --help")


class HelpFormatter(argparse.HelpFormatter):
    """Every command's --help (train, train.plan, train.score, ...): names like mlperf-bs1632 and
    ib-hdr stay whole on one line."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)
