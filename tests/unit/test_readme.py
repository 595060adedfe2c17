"""The README is a newcomer's way into the docs: its links lead to pages that exist, and to every page of the site.

`mkdocs build --strict` (CI) checks the links between the pages in docs/; the README lies outside the site, so
its links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]

# An inline Markdown link's target: [text](target). Code spans and fenced blocks hold none in the README.
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(markdown: str) -> list[str]:
    """The link targets of a Markdown text that are paths in the repository (no URL, no anchor of the same page)."""
    return [target for target in _LINK.findall(markdown) if not re.match(r"[a-z][a-z0-9+.-]*:|#", target)]


def nav_pages(nav: list) -> list[str]:
    """Every page a MkDocs nav lists, nested sections included."""
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_relative_links_finds_paths_only():
    text = "[a](docs/a.md) [b](https://x.org/b) [c](#here) [d](docs/d.md#part) `[e](f)` [g](mailto:x@y)"
    assert relative_links(text) == ["docs/a.md", "docs/d.md#part", "f"]


def test_nav_pages_walks_sections():
    assert nav_pages([{"Home": "index.md"}, {"Guide": [{"A": "a.md"}, "b.md"]}]) == ["index.md", "a.md", "b.md"]


def test_every_link_of_the_readme_leads_to_a_file_of_the_repository():
    readme = (ROOT / "README.md").read_text()
    broken = [target for target in relative_links(readme) if not (ROOT / target.split("#")[0]).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_the_readme_links_every_page_of_the_site():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs_dir = config.get("docs_dir", "docs")
    linked = {target.split("#")[0] for target in relative_links((ROOT / "README.md").read_text())}
    missing = [page for page in nav_pages(config["nav"]) if f"{docs_dir}/{page}" not in linked]
    assert not missing, f"pages of the site (mkdocs.yml's nav) that README.md does not link: {missing}"
