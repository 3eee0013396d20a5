"""The key docs, generated from the declarations in :mod:`chunkd.gateway.config.schema`.

``python -m chunkd.gateway.config.doc`` prints the reference (every key with its
default, as TOML); ``--keys`` prints the key tables of ``docs/config.md``; ``--write``
puts both where they live in the repository (this package's docstring,
``docs/config.md``) and ``--check`` says whether they, and ``systemd/chunkd.toml``,
agree with the declarations. ``tests/test_config.py`` runs the same checks.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from chunkd.errors import ConfigError
from chunkd.gateway.config.keys import Key, Section
from chunkd.gateway.config.schema import DOC_SECTIONS, PRICE_TABLE
from chunkd.gateway.config.values import Origin

__all__ = [
    "KEYS_END",
    "KEYS_START",
    "REFERENCE_END",
    "REFERENCE_START",
    "example_problems",
    "key_tables",
    "main",
    "reference",
    "splice",
]

#: the reference sits in the package docstring between these two
REFERENCE_START: Final = "Every key, with its default (a key left out takes the default)::\n\n"
REFERENCE_END: Final = "\n\nRelative paths"
#: the key tables of docs/config.md sit between these two lines
KEYS_START: Final = (
    "<!-- config keys: generated from gateway/config/schema.py by "
    "`python -m chunkd.gateway.config.doc --write`; tests/test_config.py checks it -->\n"
)
KEYS_END: Final = "<!-- end of config keys -->\n"

_WIDTH: Final = 88
_ROOT: Final = Path(__file__).resolve().parents[2]
_KEY_LINE: Final = re.compile(r"(?P<hash># )?(?P<key>[a-z][a-z0-9_]*) = (?P<value>.*)")


def _comment(text: str, indent: str = "") -> list[str]:
    if "=" in text:
        # The reference is read back as TOML with "# key = value" lines uncommented.
        raise ValueError(f"a key's doc must not hold '=': {text!r}")
    return textwrap.wrap(
        text, _WIDTH - len(indent) - 2, initial_indent="# ", subsequent_indent="# "
    )


def _key_line(section: Section, key: Key) -> str:
    value = key.default_toml()
    if value is None:
        assert key.example is not None, f"{section.name}.{key.name} needs an example"
        line = f"{key.name} = {key.example}"
        return line if key.required else f"# {line}"
    line = f"{key.name} = {value}"
    return f"# {line}" if section.commented else line


def reference() -> str:
    """Every section and key with its default, as TOML; unset keys commented out."""
    blocks = []
    for section in DOC_SECTIONS:
        lines = [*_comment(section.doc), section.header]
        for key in section.keys.values():
            lines += [*_comment(key.doc), _key_line(section, key)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def key_tables() -> str:
    """The key list of docs/config.md: one table per section (key, default, what)."""
    parts = []
    for section in DOC_SECTIONS:
        rows = [
            f"**`{section.header}`**: {_cell(section.doc)}.",
            "",
            "| key | default | what |",
            "| --- | --- | --- |",
        ]
        for key in section.keys.values():
            value = key.default_toml()
            default = "required" if key.required else "unset" if value is None else f"`{value}`"
            rows.append(f"| `{key.name}` | {_cell(default)} | {_cell(key.doc)} |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def splice(text: str, start: str, end: str, body: str) -> str:
    """``text`` with what lies between ``start`` and ``end`` replaced by ``body``.

    Raises:
        ValueError: ``start`` or ``end`` is missing.
    """
    head, found, rest = text.partition(start)
    if not found or end not in rest:
        raise ValueError(f"no {start.strip()!r} ... {end.strip()!r} block to fill")
    return head + start + body + end + rest.partition(end)[2]


def _reference_block() -> str:
    return textwrap.indent(reference(), "    ", lambda line: bool(line.strip()))


def example_problems(text: str, source: str = "systemd/chunkd.toml") -> list[str]:
    """What is wrong in an example config: keys missing or unknown, wrong defaults.

    Every key of every section must be there once, set or commented out
    (``# key = value``, with one space after the ``#``). A key shown with a value
    shows its default, except a required key or one whose default is unset, which
    shows any value it takes.
    """
    problems = []
    sections = {section.header: section for section in DOC_SECTIONS}
    seen: dict[str, set[str]] = {section.header: set() for section in DOC_SECTIONS}
    current: Section | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            header = stripped.split("#")[0].strip()
            if header.startswith("[cost.") and header.endswith("]"):
                header = PRICE_TABLE.header  # one price table, any name, stands for them all
            current = sections.get(header)
            if current is None:
                problems.append(f"{source}:{number}: unknown section {header}")
            continue
        match = _KEY_LINE.fullmatch(stripped)
        if match is None or current is None:
            continue
        name = match["key"]
        key = current.keys.get(name)
        where = f"{source}:{number}: {current.header} {name}"
        if key is None:
            problems.append(f"{where}: no such key")
            continue
        if name in seen[current.header]:
            problems.append(f"{where}: listed twice")
        seen[current.header].add(name)
        try:
            value = tomllib.loads(f"value = {match['value']}")["value"]
            parsed = key.kind.parse(value, Origin(source, name))
        except (tomllib.TOMLDecodeError, ConfigError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not (key.required or key.unsettable) and parsed != key.default:
            problems.append(f"{where} = {match['value']}: the default is {key.default_toml()}")
    for header, names in seen.items():
        for name in sections[header].keys:
            if name not in names:
                problems.append(f"{source}: {header} {name} is missing (set or as '# {name} = ')")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m chunkd.gateway.config.doc")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--keys", action="store_true", help="print docs/config.md's key tables")
    what.add_argument(
        "--write", action="store_true", help="update the docstring and docs/config.md"
    )
    what.add_argument("--check", action="store_true", help="check the committed docs")
    args = parser.parse_args(argv)
    if args.keys:
        sys.stdout.write(key_tables())
        return 0
    if not (args.write or args.check):
        print(reference())
        return 0
    package = Path(__file__).with_name("__init__.py")
    page = _ROOT / "docs" / "config.md"
    wanted = {
        package: splice(package.read_text(), REFERENCE_START, REFERENCE_END, _reference_block()),
        page: splice(page.read_text(), KEYS_START, KEYS_END, key_tables()),
    }
    stale = [path for path, text in wanted.items() if path.read_text() != text]
    if args.write:
        for path in stale:
            path.write_text(wanted[path])
            print(f"wrote {path}")
        stale = []
    problems = [f"{path}: not what the declarations give; run with --write" for path in stale]
    problems += example_problems((_ROOT / "systemd" / "chunkd.toml").read_text())
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
