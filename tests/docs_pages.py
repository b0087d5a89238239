"""The documents whose code blocks are tests, in a reader's order: README.md, then the docs site's pages in
the order of its navigation (mkdocs.yml). Each group is one reader's session, in one shell."""

from __future__ import annotations

from pathlib import Path

import yaml
from pytest_codeblocks import CodeBlock, extract_from_file

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MKDOCS = ROOT / "mkdocs.yml"
DOCS = ROOT / "docs"


def _flatten(nav: list) -> list[str]:
    """The page paths of a mkdocs ``nav``, sections opened in place."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _flatten(value) if isinstance(value, list) else [value]
    return pages


def site_pages() -> list[Path]:
    """The site's pages in the navigation's order."""
    return [DOCS / page for page in _flatten(yaml.safe_load(MKDOCS.read_text())["nav"])]


SESSIONS: dict[str, list[Path]] = {"README": [README], "docs": site_pages()}
"""A reader of the README alone, and a reader of the site from its first page to its last."""


def runnable_blocks(page: Path) -> list[CodeBlock]:
    """A page's shell and Python blocks (output blocks and text are not run)."""
    return [block for block in extract_from_file(page) if block.syntax in ("python", "bash", "sh")]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))
