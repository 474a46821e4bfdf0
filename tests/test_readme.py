"""README.md is the user's front door: short, in a fixed order, its links and docs/'s links alive, and
no page speaking of how or when the project was made rather than of the product."""
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
]


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


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_process_notes(page):
    found = [f"{page.name}:{number}: {line.strip()}" for number, line in prose(page)
             if any(pattern.search(line) for pattern in PROCESS_NOTES)]
    assert not found, "notes on how or when the project was made, not on the product:\n" + "\n".join(found)
