"""MkDocs hooks of the documentation site (mkdocs.yml).

- The home page is README.md and the changelog page is CHANGELOG.md, each from its one source at the
  repository root; their links are rewritten to the site's pages (`docs/x.md` -> `x.md`), and the docs'
  links to them (`../README.md`, `../CHANGELOG.md`) to those pages.
- The CLI reference replaces the body of docs/cli.md (a stub on GitHub): generated from the typer app by
  typer's own generator (`typer.cli.get_docs_for_click`) on `mhla_cli.cli.full_app`, the application
  with every command registered up front.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent

CLI_INTRO = """\
Generated from the `mhla` application by typer's documentation generator: the same text as each
command's `--help`. Human output and progress go to stderr, `--json` prints one object on stdout; exit
codes: 0 ok, 1 a check failed, 2 a usage or input error ([Robustness](robustness.md#exit-codes)).

"""


EXAMPLE = re.compile(r"(Example(?: \([^)]*\))?): (.+?)(?= Example(?: \([^)]*\))?: |$)")


def _examples(help_text: str) -> str:
    """A help text whose `Example: mhla ...` paragraphs are list items with the command as code."""
    out = []
    for para in help_text.split("\n\n"):
        if para.startswith("Example"):
            para = "\n".join(f"- {m[1]}: `{m[2].strip()}`" for m in EXAMPLE.finditer(para))
            if out and out[-1].startswith("- Example"):  # one list of the examples in a row
                out[-1] += "\n" + para
                continue
        out.append(para)
    return "\n\n".join(out)


def _polish(command) -> None:  # noqa: ANN001 (a click command of typer's bundled click)
    """For the page only: examples as code, and the commands' list showing each one's first sentence
    (click cuts short help at 45 characters)."""
    from mhla_cli.cli.help import unwrap

    if command.help:
        command.help = _examples(unwrap(command.help))
        first = command.help.split("\n\n")[0].split(". ")[0].rstrip(".")
        command.short_help = first + "."
    for sub in getattr(command, "commands", {}).values():
        _polish(sub)


def cli_reference() -> str:
    """The CLI reference page, in Markdown, from the fully registered typer app."""
    import typer
    from typer.cli import get_docs_for_click

    from mhla_cli.cli import full_app

    command = typer.main.get_command(full_app)
    _polish(command)
    ctx = typer.Context(command, info_name="mhla")
    text = get_docs_for_click(obj=command, ctx=ctx, name="mhla", title="CLI reference")
    head, _, rest = text.partition("\n\n")
    return f"{head}\n\n{CLI_INTRO}{rest.strip()}\n"


def on_files(files, config):  # noqa: ANN001, ANN201 (MkDocs' hook signature)
    """Add the pages made from files outside docs/: the home page and the changelog."""
    pages = {
        "index.md": (ROOT / "README.md").read_text(encoding="utf-8"),
        "changelog.md": (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"),
    }
    for name, content in pages.items():
        files.append(File.generated(config, name, content=content))
    return files


LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.) ")
FENCE = re.compile(r"^\s*(```|~~~)")


def lists_after_paragraphs(markdown: str) -> str:
    """A blank line before a list that follows a paragraph line: GitHub starts the list there, Python-Markdown
    (MkDocs) would read the items as text of the paragraph."""
    out, fence, prev = [], False, ""
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fence = not fence
        elif (not fence and LIST_ITEM.match(line) and prev.strip() and not LIST_ITEM.match(prev)
              and not prev.startswith((" ", "|", "<", "#"))):
            out.append("")
        out.append(line)
        prev = line
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201
    """Links written for the repository (GitHub's view) made links between the site's pages, and lists
    that follow a paragraph line started as GitHub starts them."""
    if page.file.src_uri == "cli.md":
        return cli_reference()
    markdown = lists_after_paragraphs(markdown)
    if page.file.src_uri in ("index.md", "changelog.md"):
        markdown = re.sub(r"\]\(docs/", "](", markdown)
        markdown = markdown.replace("](CHANGELOG.md", "](changelog.md")
    else:
        markdown = markdown.replace("](../README.md", "](index.md").replace("](../CHANGELOG.md", "](changelog.md")
    return markdown
