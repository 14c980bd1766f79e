"""Every `fdsched ...` command the docs show names real subcommands and flags, and the CLI's own help is tidy.

The commands are read from README.md, docs/*.md, docs/results/*.md and examples/*.md|*.sh (code blocks, inline code, shell lines;
comments dropped) and checked against the argparse tree of ``fdsched.tools.cli.build_parser``: a subcommand that does
not exist or a flag its subcommand does not take fails, naming the file and line.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fdsched.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/results/*.md"), *ROOT.glob("examples/*.md"),
                    *ROOT.glob("examples/*.sh")])


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set:
    return {opt for action in parser._actions for opt in action.option_strings}


def _walk(parser, path=()):
    yield path, parser
    for name, child in _subparsers(parser).items():
        yield from _walk(child, path + (name,))


def _commands(path: Path):
    """(line number, command text after 'fdsched') for every command the file shows."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = []
    if path.suffix == ".sh":
        chunks = [(i, line) for i, line in enumerate(lines, 1)]
    else:
        chunks, fence = [], False
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fence = not fence
                continue
            if fence or line.startswith("    "):
                chunks.append((i, line))
            else:
                # inline code; a span that starts with "[" is a log line quoted ("[fdsched] fdsched installed ...")
                chunks += [(i, span) for span in re.findall(r"`([^`]+)`", line) if not span.startswith("[")]
    joined, start = "", None
    for i, line in chunks:  # shell continuation lines
        if start is None:
            start = i
        stripped = re.sub(r"(^|\s)#.*$", "", line) if path.suffix == ".sh" or not line.startswith("`") else line
        if stripped.rstrip().endswith("\\"):
            joined += stripped.rstrip()[:-1] + " "
            continue
        joined += stripped
        code = re.sub(r"(^|\s)#\s.*$", "", joined)  # a comment after the command
        for match in re.finditer(r"(?:^|[\s(;&|])fdsched((?:\s+[^\s|;&)#]+)*)", code):
            found.append((start, match.group(1)))
        joined, start = "", None
    return found


PARSER = build_parser()
CASES = [(path, line, cmd) for path in DOC_FILES for line, cmd in _commands(path)]


def test_the_docs_show_commands():
    assert len(CASES) > 30
    assert {p.name for p, *_ in CASES} >= {"README.md", "replay.md", "ab_run.md", "enable_in_engine.sh"}


@pytest.mark.parametrize("path, line, command", CASES, ids=[f"{p.name}:{n}" for p, n, _ in CASES])
def test_a_documented_command_names_real_subcommands_and_flags(path, line, command):
    try:
        tokens = shlex.split(command, posix=True)
    except ValueError:
        tokens = command.split()
    tokens = [t.strip("[]") for t in tokens if t.strip("[]")]
    parser, where = PARSER, "fdsched"
    i = 0
    while i < len(tokens) and _subparsers(parser) and not tokens[i].startswith("-"):
        word = tokens[i]
        choices = _subparsers(parser)
        if word not in choices:
            if word in ("...", "--help", "-h") or re.fullmatch(r"[A-Z_<>.|-]+", word):
                return  # a placeholder for the subcommand
            pytest.fail(f"{path.name}:{line}: `{where} {word}`: no such subcommand; allowed: {', '.join(choices)}")
        parser, where = choices[word], f"{where} {word}"
        i += 1
    flags = _flags(parser)
    for token in tokens[i:]:
        if token.startswith("-") and token not in ("-", "--"):
            flag = token.split("=", 1)[0]
            assert flag in flags, f"{path.name}:{line}: `{where}` has no option {flag}; allowed: {', '.join(sorted(flags))}"


def test_every_option_has_help_and_no_rst_markup():
    for path, parser in _walk(PARSER):
        assert "``" not in (parser.description or ""), f"fdsched {' '.join(path)}: description shows ``"
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"fdsched {' '.join(path)} {name}: no help text"
            assert "``" not in action.help


def test_top_level_help_has_no_literal_markup(capsys):
    with pytest.raises(SystemExit):
        PARSER.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "fdsched:" in out


def test_install_instructions_install_what_exists():
    # fastdeploy-sched-plugin is on no package index yet: an instruction must install from a checkout (or a wheel)
    for path in DOC_FILES:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = re.sub(r"(^|\s)#.*$", "", line) if path.suffix == ".sh" else line
            assert not re.search(r"pip install\s+['\"]?fastdeploy-sched-plugin", code), (
                f"{path.name}:{number}: installs fastdeploy-sched-plugin from an index, where it is not: {line.strip()}"
            )
