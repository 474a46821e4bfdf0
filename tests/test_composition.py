"""Training by composition (train/loop.py): it has no base class, what saves and restores it is an
object it holds (train/saving.py's Checkpoints), and nothing outside the loop sets its attributes:
what watches or changes the run from outside goes through the loop's hooks (train/hooks.py) and its
own methods. The scan reads the packages and the scripts (AST), so it needs no run."""
import ast

from helpers import REPO

SCANNED = ("train/**/*.py", "data/**/*.py", "models/**/*.py", "scripts/**/*.py")
LOOP = REPO / "train" / "loop.py"


def _annotated_training(annotation) -> bool:
    """An annotation naming Training (as a name, or a string)."""
    if isinstance(annotation, ast.Name):
        return annotation.id == "Training"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.split(".")[-1].strip('"') == "Training"
    return False


class TrainingAssignments(ast.NodeVisitor):
    """The assignments to an attribute of a Training in one module: `x.name = ...` (also augmented,
    annotated, in a tuple, or by setattr) where x is a Training, as far as the code says so: a name
    or attribute called `training`, a parameter annotated Training, or a name bound in the function
    (or a function around it) to `Training(...)` or to a call of this module's functions that
    return a Training."""

    def __init__(self, tree: ast.Module):
        self.makers = {"Training"} | {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                                      and _annotated_training(node.returns)}
        self.scopes: list[set[str]] = [self._bound(tree.body)]
        self.found: list[tuple[int, str]] = []

    def _bound(self, body, args=None) -> set[str]:
        """Names a function (or the module) binds to a Training, itself and not its inner functions."""
        parameters = [*args.posonlyargs, *args.args, *args.kwonlyargs] if args else []
        names = {arg.arg for arg in parameters if _annotated_training(arg.annotation)}
        nodes = [*body]
        while nodes:
            node = nodes.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and self._makes(node.value):
                names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            nodes.extend(ast.iter_child_nodes(node))
        return names

    def _makes(self, call: ast.Call) -> bool:
        func = call.func
        return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")) in self.makers

    def _is_training(self, node) -> bool:
        if isinstance(node, ast.Name):
            return node.id == "training" or any(node.id in scope for scope in self.scopes)
        return isinstance(node, ast.Attribute) and node.attr == "training"

    def visit_FunctionDef(self, node) -> None:
        self.scopes.append(self._bound(node.body, node.args))
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _targets(self, target) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._targets(element)
        elif isinstance(target, ast.Attribute) and self._is_training(target.value):
            self.found.append((target.lineno, target.attr))

    def visit_Assign(self, node) -> None:
        for target in node.targets:
            self._targets(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node) -> None:
        self._targets(node.target)
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Call(self, node) -> None:
        if getattr(node.func, "id", "") == "setattr" and node.args and self._is_training(node.args[0]):
            self.found.append((node.lineno, "setattr"))
        self.generic_visit(node)


def training_assignments(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of each assignment to an attribute of a Training in `source`."""
    tree = ast.parse(source)
    scan = TrainingAssignments(tree)
    scan.visit(tree)
    return scan.found


def test_training_has_no_base_class_and_holds_its_checkpoints():
    from train.loop import Training
    from train.saving import Checkpoints
    assert Training.__bases__ == (object,), Training.__bases__
    training = next(node for node in ast.walk(ast.parse(LOOP.read_text()))
                    if isinstance(node, ast.ClassDef) and node.name == "Training")
    init = next(node for node in training.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    held = {target.attr for node in ast.walk(init) if isinstance(node, ast.Assign) for target in node.targets
            if isinstance(target, ast.Attribute) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", "") == Checkpoints.__name__}
    assert held == {"checkpoints"}, held


def test_nothing_outside_the_loop_sets_an_attribute_of_a_training():
    found = []
    for pattern in SCANNED:
        for path in sorted(REPO.glob(pattern)):
            if path != LOOP:
                found += [f"{path.relative_to(REPO)}:{line} .{name}" for line, name in training_assignments(path.read_text())]
    assert not found, f"set through a method of Training or a hook of the loop (train/hooks.py), not from outside: {found}"


def test_the_scan_sees_each_way_of_naming_a_training():
    """The scan finds what it must (each kind of name for a Training) and leaves the rest alone."""
    source = '''
def training_of(setup) -> "Training":
    return Training(setup)

class Timer:
    def run_started(self, training):
        self.training = training             # (the hook's own attribute)
        training.lr = 0.1                    # 1
        self.training.commit = None          # 2
        training.state.step = 3              # (an attribute of its state, not of the Training)

def bench(setup, other):
    run = training_of(setup)
    run.loader_batch, x = (1, 1), 2          # 3
    built = Training(setup)
    built.train_step += 1                    # 4
    setattr(run, "train_step", None)         # 5
    other.lr = 0.1                           # (not a Training)
    def inner():
        run.cfg = None                       # 6

def timed(step: "Training", loader):
    step.lr = 1                              # 7
    loader.set_batch_size = print            # (a loader: test_hooks.py's scan)
'''
    found = training_assignments(source)
    assert [name for _, name in found] == ["lr", "commit", "loader_batch", "train_step", "setattr", "cfg", "lr"], found
