"""The shape of the code: data/ is a leaf package without import cycles, functions stay short, the
engines satisfy one protocol, every choice the CLI offers comes from a registry, and tests share
their helpers through tests/helpers."""
import ast
import inspect
from pathlib import Path

import pytest

from train import engines
from train.config import Config, choices, parser

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
    assert isinstance(engines.SingleProcess(Config()), engines.Engine)


def test_choices_in_help_and_validation_come_from_the_registries():
    from data import LOADERS
    from train.optim import OPTIMIZERS
    from train.schedule import SCHEDULES
    named = choices()
    assert named["loader"] == tuple(LOADERS) and named["optimizer"] == tuple(OPTIMIZERS)
    assert named["lr_schedule"] == tuple(SCHEDULES) and named["engine"] == ("auto", *engines.ENGINES)
    help_text = "".join(parser().format_help().split())  # (argparse wraps lines, even at hyphens)
    assert "oneof" + ",".join(OPTIMIZERS) in help_text and "oneof" + ",".join(SCHEDULES) in help_text
