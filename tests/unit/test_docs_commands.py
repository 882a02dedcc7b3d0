"""README.md and docs/*.md against the code they describe.

Every ``kvhive serve`` and ``kvhive gateway`` command they show (in a code block or an inline code
span) names only flags that command's parser has; every relative link between the pages resolves
to a file, and an anchor to one of its headings; every module path they name exists; and the option
tables of docs/serve.md and docs/gateway.md are what ``scripts/option_tables.py`` makes of the
parsers.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvhive.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
COMMAND = re.compile(r"\bkvhive (serve|gateway)\b(.*)")
COMMAND_END = re.compile(r"\s(?:&&?|;|\|\|?|#)(?:\s|$)|\s&$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MODULE_PATH = re.compile(r"(?<![\w./~$-])kvhive/[\w/]*\w(?:\.py)?")
MODULE_NAME = re.compile(r"(?<![\w./-])kvhive(?:\.[a-z_]\w*)+")


@dataclass(frozen=True)
class Command:
    """One ``kvhive serve`` or ``kvhive gateway`` command line shown in a page."""

    page: str
    subcommand: str
    arguments: str

    def tokens(self) -> list[str]:
        """Its arguments split as a shell would (plainly, where its quotes do not balance)."""
        try:
            return shlex.split(self.arguments)
        except ValueError:
            return self.arguments.split()

    def flags(self) -> list[str]:
        """The option names it uses, without their ``=value``."""
        return [token.split("=", 1)[0] for token in self.tokens() if token.startswith("--")]


def balanced(text: str) -> bool:
    """Whether ``text`` splits as shell words (its quotes close)."""
    try:
        shlex.split(text)
    except ValueError:
        return False
    return True


def block_lines(code: str) -> list[str]:
    """A code block's command lines: continuations joined, and a line whose quote runs on (a JSON
    argument over several lines) joined with the lines up to where the quote closes."""
    lines, pending = [], ""
    for line in re.sub(r"\\\n", " ", code).splitlines():
        pending = f"{pending} {line}" if pending else line
        if not COMMAND.search(pending) or balanced(pending):
            lines.append(pending)
            pending = ""
    return [*lines, pending] if pending else lines


def code_texts(text: str) -> list[str]:
    """The code a page shows: each fenced block's command lines and each inline code span."""
    pieces = []
    for match in FENCE.finditer(text):
        pieces.extend(block_lines(match.group(2)))
    prose = FENCE.sub("", text)
    pieces.extend(match.group(1) for match in INLINE_CODE.finditer(prose))
    return pieces


def page_commands(page: Path) -> list[Command]:
    """Every ``kvhive serve``/``kvhive gateway`` command line of ``page``."""
    commands = []
    for code in code_texts(page.read_text()):
        for match in COMMAND.finditer(code):
            arguments = COMMAND_END.split(match.group(2), maxsplit=1)[0]
            commands.append(Command(page.name, match.group(1), arguments))
    return commands


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every spelling of every option of ``parser``."""
    return {name for action in parser._actions for name in action.option_strings}


ALL_COMMANDS = [command for page in PAGES for command in page_commands(page)]


def test_the_pages_show_both_commands() -> None:
    shown = {(c.page, c.subcommand) for c in ALL_COMMANDS}
    assert {("README.md", "serve"), ("README.md", "gateway"), ("serve.md", "serve"),
            ("gateway.md", "gateway")} <= shown


@pytest.mark.parametrize("subcommand", ["serve", "gateway"])
def test_every_flag_a_page_shows_is_one_the_command_has(subcommand: str) -> None:
    known = option_strings(build_parser()[1][subcommand])
    unknown = [f"{c.page}: kvhive {subcommand}{c.arguments} -> {flag}"
               for c in ALL_COMMANDS if c.subcommand == subcommand for flag in c.flags() if flag not in known]
    assert not unknown, "\n".join(unknown)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks' ``#`` lines are not headings)."""
    anchors: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        base = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        anchor, count = base, 0
        while anchor in anchors:
            count += 1
            anchor = f"{base}-{count}"
        anchors.add(anchor)
    return anchors


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or anchor in that file, does not exist."""
    broken = []
    for match in LINK.finditer(FENCE.sub("", page.read_text())):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(f"{page.name}: {target} (no such heading)")
        elif anchor and resolved.is_dir():
            broken.append(f"{page.name}: {target} (an anchor into a directory)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page)


def test_readme_links_every_page() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    index = (REPO_ROOT / "docs" / "README.md").read_text()
    for page in PAGES[1:]:
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not list {page.name}"
    assert "(docs/README.md)" in readme


def missing_modules(text: str) -> list[str]:
    """The module paths (``kvhive/a/b.py``) and dotted names (``kvhive.a.b``) in ``text`` that name
    nothing in the package."""
    missing = []
    for match in MODULE_PATH.finditer(text):
        path = REPO_ROOT / match.group(0)
        if not (path.exists() or path.with_suffix(".py").exists()):
            missing.append(match.group(0))
    for match in MODULE_NAME.finditer(text):
        parts = match.group(0).split(".")
        found = (REPO_ROOT / parts[0] / parts[1]).is_dir() or (REPO_ROOT / parts[0] / f"{parts[1]}.py").exists()
        for depth in range(2, len(parts)):
            prefix = REPO_ROOT.joinpath(*parts[:depth])
            if not prefix.is_dir():
                break
            found = (prefix / parts[depth]).is_dir() or (prefix / f"{parts[depth]}.py").exists() or found
        if not found:
            missing.append(match.group(0))
    return missing


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_module_a_page_names_exists(page: Path) -> None:
    assert not missing_modules(page.read_text())


def load_option_tables():
    """scripts/option_tables.py, imported from its file (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("option_tables", REPO_ROOT / "scripts" / "option_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("subcommand", ["serve", "gateway"])
def test_option_tables_are_what_the_parsers_say(subcommand: str) -> None:
    tables = load_option_tables()
    page = tables.TABLE_PAGES[subcommand]
    text = page.read_text()
    table = tables.command_table(build_parser()[1][subcommand])
    assert tables.with_table(text, subcommand, table) == text, \
        f"{page.name}'s option table is stale: run python scripts/option_tables.py"
    parser = build_parser()[1][subcommand]
    listed = set(re.findall(r"^\| `(--[\w-]+)", text, re.M))
    assert {a.option_strings[0] for a in parser._actions if a.option_strings and "-h" not in a.option_strings} <= listed


def test_the_checks_catch_a_wrong_flag_a_broken_link_and_a_missing_module(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `flag`: here\n\n```bash\nkvhive serve --port 1 --kv-events-config '{\"a\":\n"
                    "  1}' --no-such-flag &\n```\n\nRun `kvhive gateway --replica URL --bogus=1`; see\n"
                    "[here](#a-flag-here), [gone](#gone), [missing](nowhere.md) and `kvhive/no_such_module.py`, "
                    "`kvhive.cli`, `kvhive.no_such.name`.\n")
    commands = page_commands(page)
    assert [(c.subcommand, c.flags()) for c in commands] == [
        ("serve", ["--port", "--kv-events-config", "--no-such-flag"]), ("gateway", ["--replica", "--bogus"])]
    assert broken_links(page) == ["page.md: #gone (no such heading)", "page.md: nowhere.md (no such file)"]
    assert missing_modules(page.read_text()) == ["kvhive/no_such_module.py", "kvhive.no_such.name"]
