"""README.md is the user's front door: short, in a fixed order, its links and docs/'s links alive, and
no product file (the pages, the code, the scripts, the tests) speaking of how or when the project was
made, or of the place it was made in, rather than of the product and its users' machines."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]

# the order the README's sections come in: what it is, the two commands, quick starts, presets,
# the everyday commands, the logs and the scorer, the docs index
SECTIONS = [
    "The two commands",
    "Quick starts",
    "Presets",
    "Resume, fine-tune, evaluate, predict, export, benchmark",
    "Logs and scores",
    "Documentation",
]
QUICK_STARTS = ["CPU smoke run", "One GPU", "Eight GPUs on one node", "Two or more nodes", "Your own ImageNet"]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
# notes on how or when the project was made: session notes, issue numbers, commit hashes, verification
PROCESS_NOTES = [
    re.compile(r"session note", re.I),
    re.compile(r"\bissue\s+#?\d+", re.I),
    re.compile(r"\bcommit(?:ted)?\s+(?:at\s+|hash\s+)?[0-9a-f]{7,40}\b", re.I),
    re.compile(r"\bat\s+[0-9a-f]{7,40}\b"),
    re.compile(r"\b(?:verified|checked) (?:on|by|in) (?:the )?(?:session|CI|commit)\b", re.I),
    re.compile(r"\bseen failing\b|\bbroken on purpose\b", re.I),
    re.compile(r"\bnew-user trial\b|\bthe project's session\b", re.I),
    re.compile(r"\brehearsals? (?:found|showed)\b", re.I),
]
# words of the place the project is built in rather than of its users' machines: a lent machine, what
# may travel to it or a call must carry there, a session's time. Phrases, not words: "session"
# (a process session, pytest's, ONNX Runtime's), "lent", "carry" and "travel" have their own uses.
WORKPLACE_WORDS = [
    re.compile(r"\blent (?:GPU|machine|node|device|accelerator)|\b(?:the|a) lent\b|(?:\b|_)lent_(?:gpu|machine|node)", re.I),
    re.compile(r"\bmay travel\b|\btravel \((?:limit|at most)", re.I),
    re.compile(r"\bmust (?:be )?carr(?:y|ied)\b|\bnot carried\b|\bcarr(?:y|ies|ied|ying)\b.{0,30}\.whl\b", re.I),
    re.compile(r"\b(?:this|the|each|every|an earlier|a later|the next|the previous) session(?:'s)? "
               r"(?:time|budget|limit|found|measured|ran|checked|verified)\b", re.I),
    re.compile(r"\bdevice machine\b|\bbudget_left\b", re.I),
]
NOT_THE_PRODUCT = PROCESS_NOTES + WORKPLACE_WORDS
# the code, scripts and tests, scanned whole (their messages and comments alike); this file holds the list
CODE = sorted(path for folder in ("scripts", "tests", "train", "models", "data", ".ci")
              for path in (REPO / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts and path != Path(__file__).resolve()
              and (path.suffix in (".py", ".sh", ".sbatch", ".yaml", ".md", ".toml", ".txt") or path.name == "run"))
CODE += [REPO / name for name in ("Dockerfile", "pyproject.toml", ".dockerignore") if (REPO / name).is_file()]


def prose(path):
    """(line number, line) outside fenced code blocks: code and real output keep their own text."""
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        if not inside:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    return {slug(line.lstrip("#")) for _, line in prose(path) if re.match(r"#{1,6} ", line)}


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300"


def test_readme_sections_in_order():
    headings = [line[3:].strip() for _, line in prose(README) if line.startswith("## ")]
    assert headings == SECTIONS
    quick = [line[4:].strip() for _, line in prose(README) if line.startswith("### ")]
    assert quick == QUICK_STARTS


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/python -m train" in text
    assert "bash scripts/test.sh" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page):
    dead = []
    for number, line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append(f"{page.name}:{number}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                dead.append(f"{page.name}:{number}: {target} (no such heading)")
    assert not dead, "\n".join(dead)


def test_docs_index_lists_every_page():
    listed = set(re.findall(r"\]\((?:docs/)?([\w.-]+\.md)\)", README.read_text()))
    missing = {p.name for p in DOCS} - listed
    assert not missing, f"README's docs index lacks {sorted(missing)}"
    in_docs_index = set(re.findall(r"\]\(([\w.-]+\.md)\)", (REPO / "docs" / "README.md").read_text()))
    missing = {p.name for p in DOCS if p.name != "README.md"} - in_docs_index
    assert not missing, f"docs/README.md lacks {sorted(missing)}"


def not_the_product(lines):
    """The (number, line) pairs that speak of how the project was made or of the place it was made in."""
    return [(number, line) for number, line in lines if any(pattern.search(line) for pattern in NOT_THE_PRODUCT)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_process_notes(page):
    found = [f"{page.name}:{number}: {line.strip()}" for number, line in not_the_product(prose(page))]
    assert not found, "notes on how or when the project was made, not on the product:\n" + "\n".join(found)


@pytest.mark.parametrize("folder", ["scripts", "tests", "train", "models", "data", "the top level"])
def test_code_scripts_and_tests_speak_of_the_product(folder):
    files = [path for path in CODE if path.relative_to(REPO).parts[0] == folder
             or folder == "the top level" and path.parent in (REPO, REPO / ".ci")]
    assert files, folder
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}" for path in files
             for number, line in not_the_product(enumerate(path.read_text().splitlines(), 1))]
    assert not found, "words of the place the project was made in, not of the product:\n" + "\n".join(found)


# lines product files once held (they must be caught) and lines where the words have their own sense
SPOKE_OF_THE_WORKPLACE = [
    'echo "setup: the lent GPU machine\'s stack in .venv-device (Python 3.12, torch 2.11.0)" >&2',
    "def test_gpu_check_dry_runs_on_the_lent_machines_stack(tmp_path):",
    "DALI (hundreds of MB installed) never fits the 64 MiB that may travel; its GPU tests report `DALI absent`.",
    "mlperf-logging and no nvImageCodec. .whl/ is git-ignored, so the call must carry it.",
    "# packages) in .venv-device, and the wheels scripts/gpu_check.sh carries there in .whl/: tests/test_gpu.py",
    "# what travels: tracked and untracked-not-ignored files, shared/ if there is one, and the carried .whl/",
    'echo ".whl: $(mib "$total") in ${#wheels[@]} wheels; with the working tree $(mib $((tree + total))) travel (limit 64 MiB)"',
    "machine: pytest, torchvision and pillow were not carried (pytest 9 also needs pygments), and pytest",
    "It has not yet run on a GPU. What can be checked without one is checked on the lent machine's stack:",
    "folders down), and prints the dry run's time. Rehearsals found what would have stopped the check on",
    "the figure this session measured on the device machine",
]
SPEAKS_OF_THE_PRODUCT = [
    'session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])',
    "child = subprocess.Popen(command, start_new_session=True)",
    '"""COMMAND on NODE in a session of its own (to be killed as a group), its output to `log`."""',
    "the test's whole protocol, not in a fixture: the set-up of a module's or the session's fixtures (a",
    "MaxSessions 200",
    "lent = HOST_MEMORY.lend(size) if tensors else None",
    "fp16 with loss scaling on CPU (allowed for tests): the scaler's state travels in the checkpoint,",
    "`train/engines/wire.py` decides what travels and how the average is taken; every engine",
    "except ImportError:  # (an older torch: its files always carry checksums)",
    "A node without network takes the packages its python lacks from `.whl/`, the wheels folder that goes",
    'echo ".whl: $(mib "$total") in ${#wheels[@]} wheels; with the checkout $(mib $((tree + total))) to copy to the node"',
]


def test_the_guard_tells_the_workplace_from_the_product():
    caught = not_the_product(enumerate(SPOKE_OF_THE_WORKPLACE + SPEAKS_OF_THE_PRODUCT))
    assert [line for _, line in caught] == SPOKE_OF_THE_WORKPLACE


# a pointer into the docs from the code, the scripts, the tests or a flag's --help: docs/PAGE.md or
# docs/PAGE.md#heading
DOCS_POINTER = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")


def dead_pointers(lines, where):
    """'where:number: pointer (why)' for each docs/ pointer in (number, line) pairs whose page or heading
    does not exist."""
    dead = []
    for number, line in lines:
        for page, anchor in DOCS_POINTER.findall(line):
            target = REPO / "docs" / page
            if not target.is_file():
                dead.append(f"{where}:{number}: docs/{page} (no such page)")
            elif anchor and anchor not in anchors(target):
                dead.append(f"{where}:{number}: docs/{page}#{anchor} (no such heading)")
    return dead


def test_pointers_into_the_docs_resolve():
    dead = [pointer for path in CODE
            for pointer in dead_pointers(enumerate(path.read_text().splitlines(), 1), path.relative_to(REPO))]
    assert not dead, "pointers to pages or headings that do not exist:\n" + "\n".join(dead)


def test_the_pointer_check_sees_a_missing_page_and_a_missing_heading():
    lines = enumerate(["(docs/settings.md#--threads)", "docs/settings.md#--no-such-flag", "docs/nowhere.md",
                       "see docs/threads.md."], 1)
    assert dead_pointers(lines, "x") == ["x:2: docs/settings.md#--no-such-flag (no such heading)",
                                         "x:3: docs/nowhere.md (no such page)"]
