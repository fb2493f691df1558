"""The README is the front door (short, both commands on top, every relative link resolving);
the documentation site builds in strict mode, and its configuration page lists every key."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from flowgrpo_cli.store.config import iter_reference

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor MkDocs and GitHub give a heading (for the headings these files use)."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", text))


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_readme_is_short_with_both_commands_on_top():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300
    top = "\n".join(lines[:20])
    assert "just demo" in top and "just test" in top


def test_every_relative_link_in_the_readme_resolves():
    links = [t for t in LINK.findall(README.read_text()) if not re.match(r"\w+://", t)]
    assert links, "the README links to its docs"
    for target in links:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        assert file.exists(), f"README links to {target}: no such file"
        if anchor:
            assert anchor in _anchors(file), f"README links to {target}: no such heading"


def test_the_docs_build_strict_and_list_every_config_key(tmp_path):
    build = pytest.importorskip("mkdocs.commands.build")
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build.build(config)  # strict: a broken link, anchor or nav entry raises
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    missing = [key for key, _, _ in iter_reference() if f"<code>{key}</code>" not in page]
    assert missing == []
    shutil.rmtree(tmp_path / "site")
