"""``chunkd config show``: the effective configuration, and where each value came from.

It loads the configuration as ``chunkd serve`` would (the file, or the embedded
default without ``--config``, then the ``CHUNKD_*`` environment) and prints every key
of every section, those left at their default too, each with its origin: ``default``,
``file`` (and the path) or ``env`` (and the variable). Secrets show as ``***``. It
only reads: the embedded default's data directory is not created, no daemon is asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Final, TextIO

if TYPE_CHECKING:
    from chunkd.gateway.config.keys import Key
    from chunkd.gateway.config.load import EffectiveKey

__all__ = ["add_parser", "run", "show"]

#: the column the origins start at in the text view
_ORIGIN_COLUMN: Final = 48


def show(config_path: str | None, *, as_json: bool, out: TextIO | None = None) -> int:
    """Print the effective configuration of ``config_path`` (None: the embedded default)
    with each value's origin; returns the exit status (1: the configuration is wrong,
    and the message says where)."""
    from chunkd.errors import ConfigError
    from chunkd.gateway.config.load import explain_config

    out = sys.stdout if out is None else out
    try:
        config, keys = explain_config(config_path)
    except ConfigError as exc:
        print(f"chunkd config show: bad configuration: {exc}", file=sys.stderr)
        return 1
    if as_json:
        document = {
            "source": config.source,
            "keys": [
                {
                    "section": row.section,
                    "backend": row.backend,
                    "key": row.key,
                    "value": row.value,
                    "origin": row.origin,
                    "where": row.where,
                }
                for row in keys
            ],
        }
        json.dump(document, out, indent=2)
        out.write("\n")
        return 0
    _print_text(config.source, keys, out)
    return 0


def _print_text(source: str, keys: list[EffectiveKey], out: TextIO) -> None:
    from chunkd.gateway.config.schema import SECTIONS

    sections = {section.name: section for section in SECTIONS}
    overridden = sum(row.origin == "env" for row in keys)
    print(f"# chunkd's effective configuration: {_described(source)}", file=out)
    print(
        f"# {overridden} value(s) from CHUNKD_* variables; secrets show as ***; "
        "after each value, where it came from",
        file=out,
    )
    current: tuple[str, str | None] | None = None
    for row in keys:
        section = sections[row.section]
        if (row.section, row.backend) != current:
            current = (row.section, row.backend)
            print(f"\n{section.header}", file=out)
        line = _key_line(section.keys[row.key], row.value)
        origin = row.origin if row.where is None else f"{row.origin} {row.where}"
        print(f"{line:<{_ORIGIN_COLUMN - 1}} # {origin}", file=out)


def _described(source: str) -> str:
    from chunkd.gateway.config.load import EMBEDDED_SOURCE

    if source == EMBEDDED_SOURCE:
        return "the embedded default (no --config)"
    return f"the file {source}"


def _key_line(key: Key, value: Any) -> str:
    """``name = VALUE`` as TOML (sizes and durations as one would write them); an unset
    key as a comment."""
    from chunkd.gateway.config.values import toml_value

    if value is None:
        return f"# {key.name} unset"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{key.name} = {key.kind.write(value)}"
    return f"{key.name} = {toml_value(value)}"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd config``."""
    config = sub.add_parser(
        "config",
        help="show the effective configuration and where each value came from",
        description=(
            "chunkd config show: print every key of the configuration chunkd serve would "
            "run on (the file, or the embedded default without --config, then the "
            "CHUNKD_* variables), defaults included, each with its origin: default, file "
            "or env. Secrets show as ***. Reads only."
        ),
    )
    actions = config.add_subparsers(dest="config_command", metavar="ACTION")
    shown = actions.add_parser(
        "show",
        help="print the effective configuration with each value's origin",
        description=(
            "Print the effective configuration: every key, defaults included, each with "
            "where its value came from (default, file PATH, env VARIABLE). Secrets show "
            "as ***. Exits 1 when the configuration is wrong, saying where."
        ),
    )
    shown.add_argument(
        "--config",
        metavar="PATH",
        help="TOML config, as chunkd serve --config takes it (default: the embedded default)",
    )
    shown.add_argument(
        "--json",
        action="store_true",
        help="print {source, keys: [{section, backend, key, value, origin, where}]}",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd config ACTION``; returns the exit status."""
    if args.config_command != "show":
        print(
            "chunkd config: say what to do: chunkd config show [--config F] [--json]",
            file=sys.stderr,
        )
        return 2
    return show(args.config, as_json=args.json)
