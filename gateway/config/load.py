"""Loading: the TOML file or the embedded default, then the ``CHUNKD_*`` environment.

This is the only module of chunkd that reads the environment for configuration. The
names it accepts are the keys declared in :mod:`chunkd.gateway.config.schema`.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from chunkd.cache import CacheConfig
from chunkd.errors import ConfigError
from chunkd.gateway.config.addresses import NAME
from chunkd.gateway.config.keys import Key
from chunkd.gateway.config.schema import (
    BACKENDS,
    CACHE,
    COST,
    DATASETS,
    JOBS,
    PEERS,
    PRICE_TABLE,
    S3_FRONT,
    SERVER,
    SHIPPED_PRICES,
    BackendConfig,
    Config,
    CostConfig,
    DatasetsConfig,
    JobsConfig,
    PeersConfig,
    PriceTable,
    S3FrontConfig,
    ServerConfig,
    backend_rules,
)
from chunkd.gateway.config.values import ENVIRONMENT, PATH, Origin

__all__ = [
    "DEFAULT",
    "EMBEDDED_SOURCE",
    "ENV",
    "FILE",
    "EffectiveKey",
    "default_backend_toml",
    "embedded_default",
    "explain_config",
    "load_config",
]

_EMBEDDED: Final = "embedded default"
#: the ``source`` of a config that is the embedded default (with any overrides)
EMBEDDED_SOURCE: Final = _EMBEDDED
_GiB: Final = 1 << 30
_PEERS_TLS_KEYS: Final = ("tls_cert", "tls_key", "tls_ca")


@dataclass
class _Setting:
    value: object
    origin: Origin


@dataclass
class _Document:
    """A config before conversion: raw values, each with where it came from."""

    source: str
    server: dict[str, _Setting]
    cache: dict[str, _Setting]
    #: (name, table) per backend, in order
    backends: list[tuple[str, dict[str, _Setting]]]
    peers: dict[str, _Setting] = field(default_factory=dict)
    datasets: dict[str, _Setting] = field(default_factory=dict)
    s3_front: dict[str, _Setting] = field(default_factory=dict)
    jobs: dict[str, _Setting] = field(default_factory=dict)
    cost: dict[str, _Setting] = field(default_factory=dict)
    #: (name, table) per [cost.NAME] price table, in order
    prices: list[tuple[str, dict[str, _Setting]]] = field(default_factory=list)


#: a price table's NAME: as a backend's name, dots and all else refused
_TABLE_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


def _price_tables(
    doc: Mapping[str, Any], source: str
) -> tuple[dict[str, Any], list[tuple[str, dict[str, _Setting]]]]:
    """The ``[cost]`` table without its ``[cost.NAME]`` tables, and those tables."""
    table = doc.get("cost", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: cost is not a table; write it as a [cost] section")
    own: dict[str, Any] = {}
    prices: list[tuple[str, dict[str, _Setting]]] = []
    for name, value in table.items():
        if not isinstance(value, dict):
            own[name] = value
            continue
        if not _TABLE_NAME.fullmatch(name):
            raise ConfigError(
                f"{source}: [cost.{name}] is no price table name; name it like a backend, "
                "[a-z0-9][a-z0-9_-]{0,62}"
            )
        settings = {}
        for key, price in value.items():
            if key not in PRICE_TABLE.keys:
                raise ConfigError(
                    f"{source}: [cost.{name}] has no key {key!r}"
                    f"{_did_you_mean(key, PRICE_TABLE.keys)} (the keys of a price table: "
                    f"{', '.join(PRICE_TABLE.keys)})"
                )
            settings[key] = _Setting(price, Origin(source, f"[cost.{name}] {key}"))
        for key in PRICE_TABLE.keys.values():
            if key.required and key.name not in settings:
                raise ConfigError(
                    f"{source}: [cost.{name}] has no {key.name}; a price table gives "
                    f"{', '.join(k.name for k in PRICE_TABLE.keys.values() if k.required)} "
                    "(0 for free)"
                )
        prices.append((name, settings))
    return own, prices


def _did_you_mean(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _read_toml(source: str) -> dict[str, Any]:
    try:
        data = Path(source).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read the config file ({exc.strerror or exc}); check the path "
            "(run without --config for the embedded default)"
        ) from exc
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: is not UTF-8 text; save the config file as UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        line = re.search(r"at line (\d+)", str(exc))
        at = f" at line {line[1]}" if line else ""
        raise ConfigError(f"{source}: not valid TOML{at}: {exc}; fix the file there") from exc


def _section(
    doc: Mapping[str, Any], name: str, keys: Mapping[str, Key], source: str
) -> dict[str, _Setting]:
    table = doc.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: {name} is not a table; write it as a [{name}] section")
    settings = {}
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(
                f"{source}: [{name}] has no key {key!r}{_did_you_mean(key, keys)} "
                f"(the keys of [{name}]: {', '.join(keys)})"
            )
        settings[key] = _Setting(value, Origin(source, f"[{name}] {key}"))
    return settings


def _document_from_toml(doc: Mapping[str, Any], source: str) -> _Document:
    sections = {
        "server": SERVER.keys,
        "cache": CACHE.keys,
        "backends": BACKENDS.keys,
        "peers": PEERS.keys,
        "datasets": DATASETS.keys,
        "s3_front": S3_FRONT.keys,
        "jobs": JOBS.keys,
        "cost": COST.keys,
    }
    for key, value in doc.items():
        if key in sections:
            continue
        if isinstance(value, dict | list):
            raise ConfigError(
                f"{source}: unknown section [{key}]{_did_you_mean(key, sections)} "
                "(the sections: [server], [cache], [[backends]], [peers], [datasets], [s3_front], "
                "[jobs], [cost], [cost.NAME])"
            )
        homes = [
            "[[backends]]" if name == "backends" else f"[{name}]"
            for name, keys in sections.items()
            if key in keys
        ]
        home = f"; it belongs under {homes[0]}" if homes else ""
        raise ConfigError(f"{source}: unknown key {key!r} outside any section{home}")
    server = _section(doc, "server", SERVER.keys, source)
    cache = _section(doc, "cache", CACHE.keys, source)
    cost, prices = _price_tables(doc, source)
    tables = doc.get("backends", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(
            f"{source}: backends is not an array of tables; write [[backends]] "
            "(two brackets) above each backend"
        )
    backends: list[tuple[str, dict[str, _Setting]]] = []
    first_seen: dict[str, int] = {}
    for number, table in enumerate(tables, start=1):
        label = f"[[backends]] #{number}"
        if "name" not in table:
            raise ConfigError(f'{source}: {label} has no name; add name = "..." to it')
        name = NAME.parse(table["name"], Origin(source, f"{label} name"))
        if name in first_seen:
            raise ConfigError(
                f"{source}: {label} name = {name!r} is taken by [[backends]] "
                f"#{first_seen[name]}; give each backend its own name"
            )
        first_seen[name] = number
        label = f"[[backends]] {name!r}"
        settings = {}
        for key, value in table.items():
            if key not in BACKENDS.keys:
                raise ConfigError(
                    f"{source}: {label} has no key {key!r}{_did_you_mean(key, BACKENDS.keys)} "
                    f"(the keys of a backend: {', '.join(BACKENDS.keys)})"
                )
            settings[key] = _Setting(value, Origin(source, f"{label} {key}"))
        if "url" not in settings:
            raise ConfigError(
                f'{source}: {label} has no url; add one, like url = "s3://bucket/prefix" '
                "(or gs://, az://, file:///dir, memory://)"
            )
        backends.append((name, settings))
    return _Document(
        source,
        server,
        cache,
        backends,
        _section(doc, "peers", PEERS.keys, source),
        _section(doc, "datasets", DATASETS.keys, source),
        _section(doc, "s3_front", S3_FRONT.keys, source),
        _section(doc, "jobs", JOBS.keys, source),
        _section({"cost": cost}, "cost", COST.keys, source),
        prices,
    )


def _embedded_document(cwd: Path) -> _Document:
    source = _EMBEDDED

    def table(section: str, values: Mapping[str, object]) -> dict[str, _Setting]:
        return {k: _Setting(v, Origin(source, f"{section} {k}")) for k, v in values.items()}

    return _Document(
        source,
        server=table("[server]", {"listen": "127.0.0.1:8470", "socket": str(cwd / "chunkd.sock")}),
        cache=table(
            "[cache]",
            {
                "dir": str(cwd / "chunkd-cache"),
                "ram_bytes": 1 * _GiB,
                "disk_bytes": 10 * _GiB,
                "disk_min_free_bytes": 1 * _GiB,
            },
        ),
        backends=[
            (
                "local",
                table(
                    "[[backends]] 'local'",
                    # A directory the user edits by hand: writable (checkpoints work
                    # out of the box), and files are re-checked after a second.
                    {
                        "name": "local",
                        "url": _embedded_data_url(cwd),
                        "writable": True,
                        "revalidate": 1.0,
                    },
                ),
            )
        ],
    )


def _embedded_data_url(cwd: Path) -> str:
    return f"file://{cwd / 'chunkd-data'}"


def default_backend_toml(cwd: Path) -> str:
    """The embedded default's backend as a ``[[backends]]`` table, its url absolute for
    ``cwd``: what a config file without backends is told to add."""
    ((_, table),) = _embedded_document(Path(os.path.abspath(cwd))).backends
    lines = ["[[backends]]"]
    for name, setting in table.items():
        lines.append(f"{name} = {BACKENDS.keys[name].kind.write(setting.value)}")
    return "\n".join(lines)


def _no_backends(source: str, cwd: Path) -> str:
    # Never filled in from the embedded default: a writable file:// backend under the
    # working directory, slipped into a production config, would put checkpoints on a
    # local disk.
    return (
        f"{source}: has no [[backends]]. chunkd serves configured backends only, and a "
        "config file never gets one it does not name: the embedded default's backend "
        "'local' applies only when chunkd runs without --config. Add a [[backends]] "
        "table to the file; to keep the embedded default's, add exactly this:\n\n"
        f"{default_backend_toml(cwd)}\n\n"
        'or one for your object store: a [[backends]] table with name = "data" and '
        'url = "s3://bucket/prefix" (docs/config.md)'
    )


_SECTION_PREFIXES: Final = {
    "CHUNKD_SERVER_": ("server", SERVER.keys),
    "CHUNKD_CACHE_": ("cache", CACHE.keys),
    "CHUNKD_PEERS_": ("peers", PEERS.keys),
    "CHUNKD_DATASETS_": ("datasets", DATASETS.keys),
    "CHUNKD_S3_FRONT_": ("s3_front", S3_FRONT.keys),
    "CHUNKD_JOBS_": ("jobs", JOBS.keys),
    "CHUNKD_COST_": ("cost", COST.keys),
}
_BACKENDS_PREFIX: Final = "CHUNKD_BACKENDS_"


#: the variables Kubernetes sets in a pod for each Service of its namespace
#: (``<NAME>_SERVICE_HOST``, ``<NAME>_PORT_8470_TCP_ADDR``, ...): a Service named
#: ``chunkd-server`` makes ``CHUNKD_SERVER_SERVICE_HOST``, which is no key of chunkd's
_SERVICE_LINK: Final = re.compile(
    r"service_host|service_port(_[a-z0-9_]+)?|port(_\d+_(tcp|udp|sctp)(_(proto|port|addr))?)?"
)


def _env_name(backend: str) -> str:
    return backend.upper().replace("-", "_")


def _apply_environment(doc: _Document, environ: Mapping[str, str]) -> None:
    """Apply ``CHUNKD_SERVER_*``, ``CHUNKD_CACHE_*`` and ``CHUNKD_BACKENDS_*`` to ``doc``."""
    for var in sorted(environ):
        value = environ[var]
        origin = Origin(ENVIRONMENT, var)
        for prefix, (section, keys) in _SECTION_PREFIXES.items():
            if var.startswith(prefix):
                key = var[len(prefix) :].lower()
                if key not in keys and _SERVICE_LINK.fullmatch(key):
                    continue  # Kubernetes' own, for a Service named chunkd-server, say
                if key not in keys:
                    raise ConfigError(
                        f"environment {var}: [{section}] has no key {key!r}"
                        f"{_did_you_mean(key, keys)} (the keys of [{section}]: "
                        f"{', '.join(keys)}); fix the variable's name or unset it"
                    )
                _set(getattr(doc, section), keys[key], _Setting(value, origin))
        if var.startswith(_BACKENDS_PREFIX):
            if _SERVICE_LINK.fullmatch(var[len(_BACKENDS_PREFIX) :].lower()):
                continue
            table, key = _backend_target(doc, var)
            _set(table, BACKENDS.keys[key], _Setting(value, origin))


def _set(table: dict[str, _Setting], key: Key, setting: _Setting) -> None:
    # An empty value restores a key whose default is unset; for any other key it is
    # a value, and refused as one (an empty size, say).
    if setting.value == "" and key.unsettable:
        table.pop(key.name, None)
    else:
        table[key.name] = setting


def _backend_target(doc: _Document, var: str) -> tuple[dict[str, _Setting], str]:
    """The backend table and key a ``CHUNKD_BACKENDS_<NAME>_<KEY>`` variable names."""
    rest = var[len(_BACKENDS_PREFIX) :]
    names = ", ".join(repr(name) for name, _ in doc.backends)
    matches = []
    for name, table in doc.backends:
        head = _env_name(name) + "_"
        if rest.upper().startswith(head):
            matches.append((name, table, rest[len(head) :].lower()))
    known = [m for m in matches if m[2] in BACKENDS.keys]
    if len(known) > 1:
        raise ConfigError(
            f"environment {var} could mean backend {known[0][0]!r} or {known[1][0]!r}; "
            "rename one of them so their names differ in more than '-' and '_'"
        )
    if not known:
        if matches:
            name, _, key = max(matches, key=lambda m: len(m[0]))
            raise ConfigError(
                f"environment {var}: backend {name!r} has no key {key!r}"
                f"{_did_you_mean(key, BACKENDS.keys)} (the keys of a backend: "
                f"{', '.join(BACKENDS.keys)}); fix the variable's name or unset it"
            )
        raise ConfigError(
            f"environment {var} names no configured backend (backends: {names}); "
            "write CHUNKD_BACKENDS_<NAME>_<KEY> for a backend of the config, or unset it"
        )
    name, table, key = known[0]
    if key == "name":
        raise ConfigError(
            f"environment {var}: a backend cannot be renamed from the environment; "
            f"change name = {name!r} in the config file, or unset the variable"
        )
    return table, key


def _convert(table: Mapping[str, _Setting], keys: Mapping[str, Key], cwd: Path) -> dict[str, Any]:
    """The values of ``table`` by field name, parsed; relative paths start from ``cwd``."""
    values = {}
    for name, setting in table.items():
        key = keys[name]
        value = key.kind.parse(setting.value, setting.origin)
        if key.kind is PATH:
            value = _absolute(value, cwd)
        values[key.field] = value
    return values


def _absolute(path: Path, cwd: Path) -> Path:
    return path if path.is_absolute() else cwd / path


def _origin_of(table: Mapping[str, _Setting]) -> Callable[[str], str]:
    def where(key: str) -> str:
        return table[key].origin.where

    return where


def _build(doc: _Document, cwd: Path) -> Config:
    server = _convert(doc.server, SERVER.keys, cwd)
    # The cache library's own default directory is relative; a config file's is not.
    cache = {"dir": CACHE.keys["dir"].default, **_convert(doc.cache, CACHE.keys, cwd)}
    if not doc.backends:
        raise ConfigError(_no_backends(doc.source, cwd))
    backends = []
    for _, table in doc.backends:
        values = _convert(table, BACKENDS.keys, cwd)
        if values.get("credentials_file") is not None:
            values["credentials_file"] = str(_absolute(Path(values["credentials_file"]), cwd))
        backend_rules(values, _origin_of(table))
        backends.append(BackendConfig(**values))
    peers = _convert(doc.peers, PEERS.keys, cwd)
    if peers and "address" not in peers:
        raise ConfigError(
            f'{doc.source}: [peers] has no self; add self = "HOST:PORT" (this node\'s '
            "address as the other nodes reach it)"
        )
    if peers and "token_file" not in peers:
        raise ConfigError(
            f"{doc.source}: [peers] has no token_file; peers authenticate each other with a "
            'shared secret, so add token_file = "/etc/chunkd/token"'
        )
    tls = [key for key in _PEERS_TLS_KEYS if key in peers]
    if tls and len(tls) < len(_PEERS_TLS_KEYS):
        missing = " or ".join(key for key in _PEERS_TLS_KEYS if key not in peers)
        given = " and ".join(
            f"{key} (from {origin.key})" if (origin := doc.peers[key].origin).from_env else key
            for key in tls
        )
        raise ConfigError(
            f"{doc.source}: [peers] has {given} but no {missing}; TLS needs all three: "
            "tls_cert (this node's certificate), tls_key (its key) and tls_ca (the CA the "
            "peers' certificates chain to), or none for plain HTTP"
        )
    return Config(
        server=ServerConfig(**server),
        cache=CacheConfig(**cache),
        backends=tuple(backends),
        source=doc.source,
        peers=PeersConfig(**peers),
        datasets=DatasetsConfig(**_convert(doc.datasets, DATASETS.keys, cwd)),
        s3_front=S3FrontConfig(**_convert(doc.s3_front, S3_FRONT.keys, cwd)),
        jobs=JobsConfig(**_convert(doc.jobs, JOBS.keys, cwd)),
        cost=CostConfig(**_convert(doc.cost, COST.keys, cwd)),
        prices={
            **SHIPPED_PRICES,
            **{
                name: PriceTable(**_convert(table, PRICE_TABLE.keys, cwd))
                for name, table in doc.prices
            },
        },
    )


def _make_data_dir(config: Config, cwd: Path) -> None:
    local = config.backend("local")
    if local is None or local.url != _embedded_data_url(cwd):
        return
    try:
        Path(local.prefix).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{_EMBEDDED}: cannot create the data directory {local.prefix} "
            f"({exc.strerror or exc}); run chunkd from a writable directory, or give "
            "it a config file"
        ) from exc


def embedded_default(cwd: Path) -> Config:
    """The configuration ``chunkd serve`` runs on without a file.

    One writable backend ``local`` at ``file://{cwd}/chunkd-data`` (this function
    creates the directory if it is missing; files there are re-checked after a
    second), the cache in ``{cwd}/chunkd-cache`` sized for a laptop (1 GiB of RAM,
    10 GiB of disk, 1 GiB left free), the local socket ``{cwd}/chunkd.sock`` and
    HTTP on ``127.0.0.1:8470``. No environment overrides: :func:`load_config` with
    no path applies them.

    Raises:
        ConfigError: the data directory cannot be created.
    """
    cwd = Path(os.path.abspath(cwd))
    config = _build(_embedded_document(cwd), cwd)
    _make_data_dir(config, cwd)
    return config


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Config:
    """Read the configuration: a TOML file (or the embedded default), then overrides.

    See the module docstring for every key, its default, and the environment rules.

    Args:
        path: the TOML file; None for :func:`embedded_default`.
        environ: where ``CHUNKD_*`` overrides come from; None: ``os.environ``.
        cwd: the directory relative paths start from (and the embedded default
            lives in); None: the process's working directory.

    Returns:
        The checked configuration. Its ``source`` is ``str(path)`` or
        ``"embedded default"``.

    Raises:
        ConfigError: the file is missing, unreadable or not valid TOML (the message
            names the path, and the line for TOML errors); a section, key or
            variable is unknown, or a value is wrong (the message names the key and
            the file, or the variable).
    """
    base = _base(cwd)
    config, _ = _load(path, environ, base)
    if path is None:
        _make_data_dir(config, base)
    return config


def _base(cwd: Path | None) -> Path:
    return Path(os.path.abspath(cwd if cwd is not None else Path.cwd()))


def _load(
    path: str | Path | None, environ: Mapping[str, str] | None, base: Path
) -> tuple[Config, _Document]:
    """The config and the document it was built from; creates nothing."""
    if path is None:
        doc = _embedded_document(base)
    else:
        source = str(path)
        doc = _document_from_toml(_read_toml(source), source)
    _apply_environment(doc, os.environ if environ is None else environ)
    return _build(doc, base), doc


#: where an effective value came from (:class:`EffectiveKey`)
DEFAULT: Final = "default"
FILE: Final = "file"
ENV: Final = "env"


@dataclass(frozen=True)
class EffectiveKey:
    """One key of the effective configuration, and where its value came from."""

    #: the section's name: "server", "cache", "peers", "datasets", "s3_front", "backends"
    section: str
    #: the backend's name, for a key of [[backends]]; None otherwise
    backend: str | None
    #: the key as written in TOML
    key: str
    #: the value as ``Config.redacted()`` shows it: secrets ``"***"``, an unset key None
    value: Any
    #: ``"default"`` (the declared default, or the embedded default's own value),
    #: ``"file"`` or ``"env"``
    origin: str
    #: the file (for ``"file"``) or the variable (for ``"env"``); None for a default
    where: str | None


def explain_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[Config, list[EffectiveKey]]:
    """The configuration :func:`load_config` gives, with every key's value and origin.

    Every key of every section is listed, those left at their default too, in the
    order the reference lists them (``[[backends]]`` once per backend). Unlike
    :func:`load_config` it creates nothing (not the embedded default's data
    directory): it is for ``chunkd config show`` and ``chunkd doctor``, which only look.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    config, doc = _load(path, environ, _base(cwd))
    shown = config.redacted()
    rows: list[EffectiveKey] = []

    def add(
        section: str, keys: Mapping[str, Key], table: Mapping[str, _Setting], values: Any
    ) -> None:
        backend = values["name"] if section == "backends" else None
        for name, key in keys.items():
            setting = table.get(name)
            if setting is None or setting.origin.source == _EMBEDDED:
                origin, where = DEFAULT, None
            elif setting.origin.from_env:
                origin, where = ENV, setting.origin.key
            else:
                origin, where = FILE, setting.origin.source
            rows.append(EffectiveKey(section, backend, name, values[key.field], origin, where))

    add("server", SERVER.keys, doc.server, shown["server"])
    add("cache", CACHE.keys, doc.cache, shown["cache"])
    add("peers", PEERS.keys, doc.peers, shown["peers"])
    add("datasets", DATASETS.keys, doc.datasets, shown["datasets"])
    add("s3_front", S3_FRONT.keys, doc.s3_front, shown["s3_front"])
    add("jobs", JOBS.keys, doc.jobs, shown["jobs"])
    add("cost", COST.keys, doc.cost, shown["cost"])
    for (_, table), values in zip(doc.backends, shown["backends"], strict=True):
        add("backends", BACKENDS.keys, table, values)
    return config, rows
