"""The task pages (docs/tasks/*.md): one per task a user comes with, each short, each with a block that runs as
written (tests/tools/test_doc_commands.py runs them), each ending with what to read next, every relative link
resolving, and README.md linking them before the reference pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "docs" / "tasks"
PAGES = sorted(TASKS.glob("*.md"))
MAX_LINES = 150
# The tasks of issue 56, in README's order.
EXPECTED = ["one-gpu.md", "many-gpus.md", "axolotl.md", "trainer.md", "will-it-fit.md", "policy-auto.md"]
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_every_task_has_its_page() -> None:
    assert sorted(p.name for p in PAGES) == sorted(EXPECTED)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_a_task_page_is_short_runs_and_says_what_to_read_next(page: Path) -> None:
    text = page.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"{page.name}: {len(lines)} lines, over {MAX_LINES}: move detail to a reference"
    assert "<!-- runnable -->" in text, f"{page.name}: no runnable block (<!-- runnable --> before a bash/python block)"
    last = text.rsplit("\n## ", 1)[-1]
    assert last.startswith("Read next") and _LINK.search(last), f"{page.name}: does not end with '## Read next' links"


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, each space a `-`."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_a_task_page_links_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target, anchor in _LINK.findall(text):
        if target.startswith("http"):
            continue
        doc = page.parent / target
        if not doc.exists() or (anchor and doc.suffix == ".md" and anchor[1:] not in _anchors(doc)):
            broken.append(target + anchor)
    assert not broken, f"{page.name}: links to missing files or headings {broken}"


def test_readme_links_the_task_pages_first() -> None:
    readme = (ROOT / "README.md").read_text()
    links = [target for target, _ in _LINK.findall(readme) if target.startswith("docs/")]
    tasks = [f"docs/tasks/{name}" for name in EXPECTED]
    assert links[:len(tasks)] == tasks, f"README.md's first docs links should be the task pages in order: {links[:8]}"
