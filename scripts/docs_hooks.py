"""MkDocs hooks for the documentation site (mkdocs.yml `hooks:`).

- The configuration page's reference table is generated from the typed config at build time
  (`iter_reference`, what `flowgrpo config --reference` prints), so it cannot drift from the
  code.
- The toy-OCR experiment log and its charts stay in examples/toy_ocr/, beside the scripts that
  made them; the site serves them from there under toy_ocr/.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIG_MARKER = "<!-- config-reference"


def on_files(files, config):
    served = [*sorted((EXAMPLES / "toy_ocr").glob("*.md")),
              *sorted((EXAMPLES / "toy_ocr" / "results").glob("*.png"))]  # fmt: skip
    for path in served:
        files.append(
            File(
                path.relative_to(EXAMPLES).as_posix(),
                str(EXAMPLES),
                config["site_dir"],
                config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "configuration.md":
        return markdown
    lines = markdown.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(CONFIG_MARKER)]
    if len(at) != 1:
        found = len(at)
        raise ValueError(f"configuration.md: expected one `{CONFIG_MARKER}` line, found {found}")
    return "\n".join([*lines[: at[0]], *config_reference_table(), *lines[at[0] + 1 :]])


def config_reference_table() -> list[str]:
    """Every config key with its default and meaning, as a Markdown table."""
    from flowgrpo_cli.store.config import iter_reference

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, meaning in iter_reference():
        rows.append(f"| `{key}` | `{cell(default)}` | {cell(meaning)} |")
    return rows
