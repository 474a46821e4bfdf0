"""The shape of the code: data/ is a leaf package without import cycles, functions stay short, the
engines satisfy one protocol, every choice the CLI offers comes from a registry, and tests share
their helpers through tests/helpers."""
import ast
import inspect
import sys
from pathlib import Path

import pytest

from train import engines
from train.engines.single import SingleProcess
from train.cli import choices, parser
from train.config import Config

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_data_is_a_leaf_package_without_import_cycles():
    graph = {}
    for path in sorted((REPO / "data").glob("*.py")):
        module = "data" if path.stem == "__init__" else f"data.{path.stem}"
        imports = imported_modules(path)
        assert not [m for m in imports if m == "train" or m.startswith("train.")], f"{path.name} imports from train/"
        graph[module] = {m for m in imports if m.startswith("data.") or m == "data"} - {module}

    def visit(module, trail):
        assert module not in trail, f"import cycle: {' -> '.join([*trail, module])}"
        for other in graph.get(module, ()):
            visit(other, [*trail, module])
    for module in graph:
        visit(module, [])


PACKAGES, MOST_LINES = ("train", "data", "models"), 450


def module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def project_imports(path: Path) -> set[str]:
    """The modules of train/, data/ and models/ that a file imports, at the top or inside functions
    (both run), but not under `if TYPE_CHECKING:` (annotations only, never run). `from P import N`
    imports module P.N where that is a module, else P."""
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, or from its parents
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base)
        for child in ast.iter_child_nodes(node):
            visit(child)
    visit(ast.parse(path.read_text()))
    return {name for name in found if name.split(".")[0] in PACKAGES and name != module}


def import_graph() -> dict[str, set[str]]:
    return {module_of(path): project_imports(path)
            for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each set of modules that import each other round a circle (strongly connected, Tarjan), sorted."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def connect(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.get(module, ()):
            if other not in index:
                connect(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            members = []
            while not members or members[-1] != module:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                circles.append(sorted(members))
    for module in sorted(graph):
        if module not in index:
            connect(module)
    return sorted(circles)


def test_no_module_of_ours_imports_itself_round_a_circle():
    circles = import_circles(import_graph())
    assert not circles, "modules importing each other in a circle (move what they share below them): " + \
        "; ".join(" <-> ".join(circle) for circle in circles)


def test_the_circle_finder_finds_a_circle_and_passes_a_chain():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_import_reader_sees_lazy_imports_and_leaves_annotation_imports_out(tmp_path, monkeypatch):
    code = tmp_path / "probe.py"
    code.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from train.loop import Training\n"
                    "import yaml\ndef later():\n    from train import schedule\n    import models\n")
    monkeypatch.setattr(sys.modules[__name__], "module_of", lambda path: "train.probe")
    assert project_imports(code) == {"train.schedule", "models"}


def test_no_module_of_ours_is_longer_than_450_lines():
    long = [f"{path.relative_to(REPO)} ({n} lines)" for package in PACKAGES
            for path in sorted((REPO / package).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MOST_LINES]
    assert not long, f"split these modules (at most {MOST_LINES} lines): {long}"


def test_set_up_is_one_call_and_the_settings_reenter_few_files(tmp_path):
    """Following the settings from run(cfg) to the first step (tests/helpers/setup_walk.py): the loop
    calls start-up once, never again, and the walk comes back to a file it had left at most 6 times."""
    from helpers.setup_walk import reentries, tiny_run, walk
    steps = walk(tiny_run(str(tmp_path / "run")))
    assert steps[:2] == ["train/loop.py: run", "train/startup.py: prepare"], steps
    assert [step for step in steps if step.startswith("train/startup.py")] == ["train/startup.py: prepare"], steps
    assert len(reentries(steps)) <= 6, steps


def test_tests_share_helpers_through_tests_helpers_not_conftest():
    importing = [path.name for path in sorted((REPO / "tests").rglob("*.py"))
                 if "conftest" in imported_modules(path)]
    assert not importing, f"import the shared helpers from tests/helpers, not conftest: {importing}"


def test_no_function_in_the_packages_is_longer_than_60_lines():
    long = []
    for package in ("train", "data", "models"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 60:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


@pytest.mark.parametrize("name", sorted(engines.ENGINES))
def test_each_engine_has_the_methods_of_the_engine_protocol(name):
    engine = engines.ENGINES[name]
    methods = [m for m, value in vars(engines.Engine).items() if callable(value) and not m.startswith("_")]
    assert len(methods) >= 10 and isinstance(engine.name, str)
    for method in methods:
        assert list(inspect.signature(getattr(engine, method)).parameters) == \
            list(inspect.signature(getattr(engines.Engine, method)).parameters), method


def test_one_process_is_an_engine():
    assert isinstance(SingleProcess(Config()), engines.Engine)


def test_choices_in_help_and_validation_come_from_the_registries():
    from data import LOADERS
    from train.optim import OPTIMIZERS
    from train.schedule import SCHEDULES
    from models import ARCHS
    named = choices()  # (the Config fields' choices: the names without torch, for a fast --help)
    assert named["arch"] == tuple(ARCHS)
    assert named["loader"] == ("auto", *LOADERS) and named["optimizer"] == tuple(OPTIMIZERS)
    assert named["lr_schedule"] == tuple(SCHEDULES) and named["engine"] == ("auto", *engines.ENGINES)
    help_text = "".join(parser().format_help().split())  # (argparse wraps lines, even at hyphens)
    assert "oneof" + ",".join(OPTIMIZERS) in help_text and "oneof" + ",".join(SCHEDULES) in help_text
