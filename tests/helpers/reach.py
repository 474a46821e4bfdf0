"""Which modules of train/, data/ and models/ a set of tests reaches, read from the source (ast), not
by running them: the quick tier must still call every module (tests/test_quick_tier.py).

A test reaches a module when its body, or a fixture or helper it uses (in its file, in tests/helpers,
in another test file), names something imported from that module, or runs it as a program (`python -m
train`, `-m train.score`, scripts/make_shards.py, a tests/helpers script); and with it every module
that one imports when it is loaded, directly or through the modules it imports (their code is what it
calls). A module imported only inside a function (a path taken on some runs only, such as elastic
training) counts only where a test reaches it by itself, except in a package's __main__.py."""
import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("train", "data", "models")
TESTS = REPO / "tests"


def our_modules() -> set[str]:
    """Every module of the packages that holds code (not only a docstring), dotted (a package's
    __init__.py is the package)."""
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if [n for n in parsed(path).body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]:
                found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def with_parents(module: str) -> set[str]:
    """Importing a.b.c imports a and a.b first."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@cache
def bindings(path: Path) -> dict[str, tuple[str, str | None]]:
    """Names a file imports (anywhere in it): name -> (module, attribute or None for a module itself)."""
    bound = {}
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = (alias.name, None)
                else:
                    bound[alias.name.split(".")[0]] = (alias.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = (submodule, None) if module_file(submodule) else (node.module, alias.name)
    return bound


def top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is loaded: not those inside functions or classes."""
    found = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names if module_file(f"{node.module}.{a.name}"))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(parsed(path).body)
    return found


@cache
def loaded_with(module: str) -> frozenset[str]:
    """The module, its packages, and our modules that loading it imports, through every module it
    imports at its top."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for module in with_parents(todo.pop()):
            file = module_file(module)
            if module in seen or file is None:
                continue
            seen.add(module)
            todo += [m for m in top_level_imports(file) if ours(m)]
    return frozenset(seen)


def program(text: str) -> set[str]:
    """Our modules a string names as a program: a module run with -m (a package: its __main__, with
    what its functions import: a command imports the modules that do its work once its flags are
    read, so that --help answers without them), or a script by its file name (what the script imports)."""
    if ours(text) and module_file(text):
        main = f"{text}.__main__"
        if not module_file(main):
            return {text}
        imported = {n.module for n in ast.walk(parsed(module_file(main))) if isinstance(n, ast.ImportFrom) and n.module}
        return {text, main} | {m for m in imported if ours(m) and module_file(m)}
    if text.endswith(".py"):
        for folder in (REPO / "scripts", TESTS / "helpers"):
            if (folder / Path(text).name).is_file():
                return {m for m in top_level_imports(folder / Path(text).name) if ours(m)}
    return set()


@cache
def functions(path: Path) -> dict[str, ast.AST]:
    """The file's functions (fixtures and helpers too) and classes' methods, by name; '' is the file's
    own top-level code (run when it is imported)."""
    tree = parsed(path)
    found: dict[str, ast.AST] = {"": ast.Module(body=[n for n in tree.body if not isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[])}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found[node.name] = node
            found.update({f.name: f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))})
    return found


def test_file(module: str) -> Path | None:
    """A module of the tests folder imported by name (helpers, test_errors), as a file."""
    for candidate in (TESTS / f"{module}.py", TESTS / module / "__init__.py", TESTS / "helpers" / f"{module}.py"):
        if candidate.is_file():
            return candidate
    return None


def reached(path: Path, name: str, seen: set | None = None) -> set[str]:
    """Our modules that the function `name` of file `path` reaches (see the module's docstring)."""
    seen = set() if seen is None else seen
    if (path, name) in seen:
        return set()
    seen.add((path, name))
    node = functions(path).get(name)
    if node is None:
        return set()
    local, bound, found = functions(path), bindings(path), set()
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        used |= {a.arg for a in node.args.args}  # fixtures, by their parameter names
    for attribute in (n for n in ast.walk(node) if isinstance(n, ast.Attribute)):
        first, _, rest = (dotted(attribute) or "").partition(".")
        if first in bound and bound[first][1] is None:  # module.attribute...: the deepest module of the chain
            module = ".".join(filter(None, [bound[first][0], rest]))
            while module and not module_file(module):
                module = module.rpartition(".")[0]
            if module and ours(module):
                found.add(module)
    for used_name in used:
        if used_name in local and used_name != name:
            found |= reached(path, used_name, seen)
        elif used_name in bound:
            module, attribute = bound[used_name]
            if ours(module):
                found.add(module)
            elif test_file(module):
                found |= reached(test_file(module), attribute or "", seen)
    for text in (n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)):
        found |= program(text)
    return found


def dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def reached_by(node_ids: list[str]) -> set[str]:
    """Our modules the tests of these pytest node ids reach, with their files' top-level code."""
    found = set()
    for node_id in node_ids:
        file, _, rest = node_id.partition("::")
        function = rest.split("::")[-1].split("[")[0]
        path = REPO / file
        found |= reached(path, function) | reached(path, "")
    return set().union(*(loaded_with(m) for m in found if module_file(m)))
