"""How a key is declared: :func:`key` on a dataclass field, read back as :class:`Key`.

Write a key as ``name: T = field(default=..., metadata=key(KIND, "one line of doc"))``
(without ``default`` for a required key); :func:`keys_of` turns a dataclass's fields
into its :class:`Key` table, and a :class:`Section` is one part of the file with its
keys. :mod:`chunkd.gateway.config.schema` holds the declarations themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Final

from chunkd.gateway.config.values import Kind, Origin

__all__ = ["Key", "Section", "key", "keys_of", "normalize"]

_DECLARED: Final = "chunkd.gateway.config"


@dataclass(frozen=True)
class Key:
    """One key of a section: its name, how it is read, its default and what it does."""

    #: the key as written in TOML (and, upper-cased, in CHUNKD_<SECTION>_<KEY>)
    name: str
    #: the attribute of the section's dataclass ("address" for [peers] self)
    field: str
    kind: Kind
    #: one line of documentation
    doc: str
    #: the default; MISSING for a required key, None for one unset by default
    default: Any = MISSING
    #: TOML text of a value the docs show for a key without a default
    example: str | None = None

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def unsettable(self) -> bool:
        """Whether the default is None (unset), which an empty variable restores."""
        return self.default is None

    def default_toml(self) -> str | None:
        """The default as TOML text; None for a required or unset key without one."""
        if self.required:
            return None
        if self.default is None:
            return self.kind.unset
        return self.kind.write(self.default)


@dataclass(frozen=True)
class _Declared:
    kind: Kind
    doc: str
    example: str | None
    toml: str | None


def key(
    kind: Kind, doc: str, *, example: str | None = None, toml: str | None = None
) -> dict[str, Any]:
    """The ``metadata`` of a dataclass field that is a config key.

    Write a key as ``name: T = field(default=..., metadata=key(KIND, "doc"))``, or
    without ``default`` for a required key.

    Args:
        kind: how its values are read and its default is written.
        doc: one line for the docs.
        example: TOML text the docs show for a key without a default (required, or
            unset by default).
        toml: the key's TOML name, when it is not the field's name.
    """
    return {_DECLARED: _Declared(kind, doc, example, toml)}


def keys_of(cls: type) -> dict[str, Key]:
    """The keys of a config dataclass, in field order, by TOML name."""
    keys = {}
    for f in fields(cls):
        declared = f.metadata.get(_DECLARED)
        if declared is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no metadata=key(...)")
        name = declared.toml or f.name
        keys[name] = Key(name, f.name, declared.kind, declared.doc, f.default, declared.example)
    return keys


def normalize(obj: object, keys: Mapping[str, Key], source: str) -> None:
    """Check (and convert in place) the fields of a frozen config dataclass."""
    for k in keys.values():
        value = getattr(obj, k.field)
        if value is None and k.unsettable:
            continue
        object.__setattr__(obj, k.field, k.kind.parse(value, Origin(source, k.field)))


@dataclass(frozen=True)
class Section:
    """One section of the file: its keys in the order the docs list them."""

    #: "server", "cache", "peers" or "backends" (CHUNKD_<NAME>_...)
    name: str
    #: as written in TOML: "[server]", "[[backends]]"
    header: str
    #: one line for the docs
    doc: str
    keys: Mapping[str, Key]
    #: the docs comment every key out (a [peers] with any key needs self and token_file)
    commented: bool = False
