"""The configuration's frozen dataclasses, and every key, each declared once.

A key is a dataclass field with ``metadata=key(...)`` (see
:mod:`chunkd.gateway.config.keys`): its default (the field's), the
:class:`~chunkd.gateway.config.values.Kind` that reads its values, and one line of
documentation. The
``[cache]`` section is the cache library's :class:`~chunkd.cache.CacheConfig`, whose
defaults live there; its keys are declared in :data:`CACHE`. From these
declarations come the key tables the loader checks names against, the environment
overrides, the reference in this package's docstring, ``systemd/chunkd.toml``'s
check and the key tables of ``docs/config.md`` (``python -m chunkd.gateway.config.doc``).

It is one job at ~930 lines: the declarations of every section and key, each with its
default, its kind and its line of documentation (most lines are those), with the few
rules a section's values keep together (``__post_init__``) and :meth:`Config.redacted`,
the one JSON view of these same dataclasses. What the declarations use is in rooms
beside it: the declaring itself (:mod:`~chunkd.gateway.config.keys`), reading values
(:mod:`~chunkd.gateway.config.values`), addresses, each backend kind's own keys
(:mod:`~chunkd.gateway.config.kinds`) and loading (:mod:`~chunkd.gateway.config.load`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Final

from chunkd.cache import CacheConfig, FsyncPolicy, WritePolicy
from chunkd.errors import ConfigError, InvalidKeyError
from chunkd.gateway.config.addresses import (
    ENDPOINT,
    LISTEN,
    MEMBERS,
    NAME,
    URL,
    split_listen,
)
from chunkd.gateway.config.keys import Key, Section, key, keys_of, normalize
from chunkd.gateway.config.kinds import BackendKind, kind_of
from chunkd.gateway.config.values import (
    BOOL,
    CHUNK_SIZE,
    COUNT,
    DURATION,
    PATH,
    POSITIVE_COUNT,
    POSITIVE_DURATION,
    PRICE,
    REVALIDATE,
    SECRET,
    SIZE,
    SOCKET_MODE,
    TEXT,
    Kind,
    Origin,
    Secret,
    choice,
    enum_of,
    parse_text,
    where_from,
)
from chunkd.gateway.names import validate_key

__all__ = [
    "BACKENDS",
    "CACHE",
    "COST",
    "DATASETS",
    "DOC_SECTIONS",
    "JOBS",
    "NOT_CACHE_KEYS",
    "PEERS",
    "PRICE_TABLE",
    "S3_FRONT",
    "SECTIONS",
    "SERVER",
    "SHIPPED_PRICES",
    "BackendConfig",
    "Config",
    "CostConfig",
    "DatasetsConfig",
    "JobsConfig",
    "PeersConfig",
    "PriceTable",
    "S3FrontConfig",
    "ServerConfig",
]


def backend_rules(values: Mapping[str, Any], where: Callable[[str], str]) -> None:
    """Checks across the keys of one backend, its kind's (:mod:`chunkd.gateway.config.kinds`:
    credentials in pairs, plain http only with ``allow_http``, no writes to a read-only
    kind); ``where(key)`` names a key in messages. (The keys of other kinds are refused
    when the backend is made: :meth:`BackendKind.refuse_others`.)"""
    kind = kind_of(str(values["url"]).partition("://")[0])
    if kind is not None:  # the URL's own check names an unknown scheme
        kind.check(values, where)


# -- the sections -------------------------------------------------------------------

_LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class ServerConfig:
    """The ``[server]`` section. Every field has the default shown.

    Fields are checked (and strings such as ``socket_mode="0660"`` converted) when
    the object is made; a bad value raises :class:`~chunkd.errors.ConfigError`.
    """

    listen: str = field(
        default="127.0.0.1:8470",
        metadata=key(
            LISTEN,
            'HTTP listener, host:port; IPv6 as "[::1]:8470", "0.0.0.0:8470" for every interface',
        ),
    )
    socket: Path = field(
        default=Path("/run/chunkd/chunkd.sock"),
        metadata=key(PATH, "local socket for the trainers of this node"),
    )
    socket_mode: int = field(
        default=0o660,
        metadata=key(
            SOCKET_MODE,
            'its permissions: a string "0660" or TOML octal 0o660 (a plain integer is a number)',
        ),
    )
    socket_group: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "group owning the socket, a name or a numeric GID; unset: the daemon's own",
            example='"train"',
        ),
    )
    admin_group: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "group, a name or a numeric GID, whose members may change and delete every "
            "user's checkpoints and datasets on the local socket, as root and the daemon's "
            "own user may (docs/security.md); unset: none",
            example='"chunkd-admin"',
        ),
    )
    socket_max_clients: int = field(
        default=1024,
        metadata=key(
            POSITIVE_COUNT,
            "local socket connections served at once; more wait to be accepted (a dropped "
            "one still counts until its client reads or closes what it was sent)",
        ),
    )
    socket_send_timeout: float = field(
        default=30.0,
        metadata=key(
            POSITIVE_DURATION,
            "a local client whose socket takes no bytes this long, or that asks again and "
            "leaves an answer with fds unread this long, is dropped (a stuck reader; "
            "chunkd_local_stuck_clients_total)",
        ),
    )
    shutdown_timeout: float = field(
        default=10.0, metadata=key(DURATION, "how long a stop waits for requests in flight")
    )
    header_timeout: float = field(
        default=10.0,
        metadata=key(
            POSITIVE_DURATION,
            "HTTP port and S3 front: a new connection's first request head (and its TLS "
            "handshake), or a later head from its first byte, must arrive whole within this; "
            "else the connection is closed",
        ),
    )
    idle_timeout: float = field(
        default=60.0,
        metadata=key(
            POSITIVE_DURATION,
            "HTTP port and S3 front: a kept-alive connection that starts no next request "
            "within this is closed",
        ),
    )
    body_timeout: float = field(
        default=60.0,
        metadata=key(
            POSITIVE_DURATION,
            "HTTP port and S3 front: a request body must arrive whole within this of its "
            "head; else the connection is closed",
        ),
    )
    max_connections: int = field(
        default=1024,
        metadata=key(
            POSITIVE_COUNT,
            "connections from non-peers, both ports together (at most a quarter of the fd "
            "limit); past it the one idle longest is closed, or the new one (docs/security.md)",
        ),
    )
    max_connections_per_address: int = field(
        default=128,
        metadata=key(
            POSITIVE_COUNT,
            "of those, from one client address (loopback has no cap of its own)",
        ),
    )
    peer_connections: int = field(
        default=1024,
        metadata=key(
            POSITIVE_COUNT,
            "connections from [peers] members' addresses: a budget of their own that "
            "non-peers cannot take (at most a quarter of the fd limit)",
        ),
    )
    log_format: str = field(
        default="json", metadata=key(choice("json", "text"), '"json" (one object a line) or "text"')
    )
    log_level: str = field(
        default="info",
        metadata=key(choice(*_LOG_LEVELS), '"debug", "info", "warning", "error" or "critical"'),
    )
    token: Secret | None = field(
        default=None,
        metadata=key(
            SECRET,
            "shared secret non-loopback clients send as 'Authorization: Bearer TOKEN' on data "
            "routes; unset: they get 403 (never a proxy)",
            example='"..."',
        ),
    )
    prefetch_in_flight: int = field(
        default=64,
        metadata=key(
            POSITIVE_COUNT, "objects loaded at once for prefetch and warm, all clients together"
        ),
    )
    prefetch_per_client: int = field(
        default=8,
        metadata=key(POSITIVE_COUNT, "of those, at once for one client (a user id of the node)"),
    )
    readahead_chunks: int = field(
        default=4,
        metadata=key(
            COUNT, "chunks read ahead of a sequential reader, past the one it reads; 0: none"
        ),
    )
    span_chunks: int = field(
        default=64,
        metadata=key(
            POSITIVE_COUNT, "most chunks one backend GET fetches for a run of cold chunks"
        ),
    )

    inspect_workers: int = field(
        default=2,
        metadata=key(
            POSITIVE_COUNT,
            "processes that decode files for the inspector (Parquet, tar, MDS); the daemon "
            "itself never decodes",
        ),
    )
    inspect_timeout: float = field(
        default=10.0,
        metadata=key(
            POSITIVE_DURATION, "most one inspector request may take; its worker is killed after"
        ),
    )
    inspect_memory: int = field(
        default=2 << 30,
        metadata=key(SIZE, "address space of each inspector worker; past it the request fails"),
    )

    def __post_init__(self) -> None:
        normalize(self, SERVER.keys, "ServerConfig")

    @property
    def host(self) -> str:
        """The host part of :attr:`listen`, without brackets: ``"::1"``, ``"0.0.0.0"``."""
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        """The port of :attr:`listen`."""
        return split_listen(self.listen)[1]


@dataclass(frozen=True)
class PeersConfig:
    """The ``[peers]`` section. Every field has the default shown; no ``self``: no peers."""

    address: str | None = field(
        default=None,
        metadata=key(
            LISTEN,
            "this node's address (host:port), as the others reach it; unset: no peers",
            example='"10.0.0.7:8470"',
            toml="self",
        ),
    )
    members: tuple[str, ...] = field(
        default=(),
        metadata=key(
            MEMBERS,
            "a static list of host:port (self may be in it), each maybe with labels after it: "
            "rack is its failure domain for replicas",
            example='["10.0.0.7:8470 rack=r1"]',
        ),
    )
    members_file: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "a file of members, one host:port and its labels (rack: the failure domain) a line "
            "('#' comments), re-read when it changes",
            example='"/etc/chunkd/peers"',
        ),
    )
    dns: str | None = field(
        default=None,
        metadata=key(
            LISTEN,
            "name:port whose A/AAAA records are the members, re-resolved every health_interval",
            example='"chunkd.train.svc:8470"',
        ),
    )
    token_file: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "the file holding the shared secret every peer request carries (needed with self)",
            example='"/etc/chunkd/token"',
        ),
    )
    timeout: float = field(
        default=2.0,
        metadata=key(
            POSITIVE_DURATION,
            "a peer silent this long is probed, and skipped if the probe fails; also the connect "
            "timeout",
        ),
    )
    request_timeout: float = field(
        default=120.0,
        metadata=key(
            POSITIVE_DURATION,
            "most one request to a peer may take in all, however healthy the peer stays",
        ),
    )
    health_interval: float = field(
        default=1.0, metadata=key(POSITIVE_DURATION, "how often each peer's /healthz is probed")
    )
    down_after: int = field(
        default=3, metadata=key(COUNT, "failed probes in a row before a peer is marked down")
    )
    up_after: int = field(
        default=2, metadata=key(COUNT, "passed probes in a row before a down peer is up again")
    )
    per_peer_requests: int = field(
        default=4,
        metadata=key(
            POSITIVE_COUNT,
            "chunk requests this node has in flight to any one peer; a restore pipelines its "
            "chunks over several owners and holders at once within it",
        ),
    )
    holder_fanout: int = field(
        default=4,
        metadata=key(
            POSITIVE_COUNT,
            "copies of one chunk a node sends to other nodes before the chunk's owner sends "
            "further askers to nodes that hold it (holders serve)",
        ),
    )
    holder_ttl: float = field(
        default=600.0,
        metadata=key(
            POSITIVE_DURATION,
            "how long a chunk's owner remembers which nodes hold it",
        ),
    )
    replicas: int = field(
        default=0,
        metadata=key(
            COUNT,
            "peers (in other failure domains) whose RAM gets a copy of each save's chunks, "
            "unless the save names its own count (async_save replicas); 0: none",
        ),
    )
    replica_budget: int = field(
        default=1 << 30,
        metadata=key(
            SIZE,
            "RAM this node gives to other nodes' replicas; a push past it is refused (the "
            "saver's save completes with fewer replicas, counted)",
        ),
    )
    tls_cert: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "TLS (all three tls_ keys, or none): this node's certificate chain, PEM, its SANs "
            "naming the host of self; the HTTP port then serves HTTPS only",
            example='"/etc/chunkd/node.pem"',
        ),
    )
    tls_key: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "the private key of tls_cert, PEM, unencrypted (chmod 600)",
            example='"/etc/chunkd/node.key"',
        ),
    )
    tls_ca: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "the CA(s), PEM, peers' certificates (server and client) must chain to",
            example='"/etc/chunkd/ca.pem"',
        ),
    )

    @property
    def enabled(self) -> bool:
        """Whether this node shares chunks with peers."""
        return self.address is not None

    @property
    def tls_enabled(self) -> bool:
        """Whether the HTTP port and the peer requests use TLS."""
        return self.tls_cert is not None


def _registry(value: object, origin: Origin) -> str:
    """``BACKEND/PREFIX``: a backend name and a key prefix (the backend is looked up
    when the registry is first used, so a config without it still serves reads)."""
    text = parse_text(value, origin).strip("/")
    backend, _, prefix = text.partition("/")
    problem = None
    if not prefix:
        problem = "names no prefix; write it as 'BACKEND/PREFIX', like 'local/datasets'"
    else:
        NAME.parse(backend, origin)
        try:
            validate_key(prefix)
        except InvalidKeyError as exc:
            problem = f"has a prefix chunkd cannot use as a key ({exc})"
    if problem is not None:
        raise origin.error(value, problem)
    return f"{backend}/{prefix}"


#: ``BACKEND/PREFIX``
_REGISTRY: Final = Kind(_registry)


@dataclass(frozen=True)
class DatasetsConfig:
    """The ``[datasets]`` section. Every field has the default shown."""

    registry: str = field(
        default="local/datasets",
        metadata=key(
            _REGISTRY,
            "BACKEND/PREFIX of a writable backend where dataset snapshots, their versions, "
            "tags and frozen chunks live; every node with the same registry sees the same names",
        ),
    )

    decoded_bytes: int = field(
        default=1 << 30,
        metadata=key(
            SIZE,
            "decoded dataset units the daemon holds for its readers, as sealed memfds of "
            "Arrow IPC (docs/decoding.md); the least recently used go past it; 0: the daemon "
            "decodes nothing and readers decode in-process",
        ),
    )
    decode_workers: int = field(
        default=2,
        metadata=key(
            COUNT,
            "processes that decode dataset units once per node for its readers; 0: none "
            "(readers decode in-process)",
        ),
    )
    decode_timeout: float = field(
        default=60.0,
        metadata=key(
            POSITIVE_DURATION,
            "most one unit's decode may take; its worker is killed after, and its readers "
            "decode in-process",
        ),
    )
    decode_memory: int = field(
        default=2 << 30,
        metadata=key(
            SIZE, "address space of each decode worker; past it the decode fails, not the node"
        ),
    )

    def __post_init__(self) -> None:
        normalize(self, DATASETS.keys, "DatasetsConfig")

    @property
    def backend(self) -> str:
        """The registry's backend."""
        return self.registry.partition("/")[0]

    @property
    def prefix(self) -> str:
        """The registry's key prefix in its backend, without a trailing ``/``."""
        return self.registry.partition("/")[2]


@dataclass(frozen=True)
class S3FrontConfig:
    """The ``[s3_front]`` section. Every field has the default shown; no ``listen``: no front.

    The front serves the backends as buckets to unchanged S3 clients (docs/s3.md).
    Every request is signed with one of its access keys (SigV4, header or presigned
    query), unless ``unsigned_from_loopback`` lets this host's unsigned requests in.
    """

    listen: str | None = field(
        default=None,
        metadata=key(
            LISTEN,
            "the S3 endpoint's own host:port, what AWS_ENDPOINT_URL names; unset: no front",
            example='"127.0.0.1:8471"',
        ),
    )
    keys_file: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "a file of access keys, 'ACCESS_KEY_ID SECRET' a line ('#' comments), chmod 600",
            example='"/etc/chunkd/s3-front.keys"',
        ),
    )
    access_key_id: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "one more access key, with secret_access_key (both from the environment, say)",
            example='"chunkd"',
        ),
    )
    secret_access_key: Secret | None = field(
        default=None,
        metadata=key(
            SECRET,
            "the secret of access_key_id (CHUNKD_S3_FRONT_SECRET_ACCESS_KEY)",
            example='"..."',
        ),
    )
    unsigned_from_loopback: bool = field(
        default=False,
        metadata=key(BOOL, "answer unsigned requests from this host (never from another)"),
    )
    max_skew: float = field(
        default=900.0,
        metadata=key(
            POSITIVE_DURATION,
            "most a signed request's time may differ from this node's clock (S3's 15 minutes)",
        ),
    )
    sigv2: bool = field(
        default=True,
        metadata=key(
            BOOL,
            "also take SigV2 signatures (boto3's default presigned URLs); false: SigV4 only",
        ),
    )
    region: str = field(
        default="us-east-1",
        metadata=key(TEXT, "the region GetBucketLocation and HeadBucket answer"),
    )
    tls_cert: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "HTTPS (with tls_key): the front's certificate chain, PEM; clients get its CA "
            "(AWS_CA_BUNDLE)",
            example='"/etc/chunkd/s3-front.pem"',
        ),
    )
    tls_key: Path | None = field(
        default=None,
        metadata=key(
            PATH,
            "the private key of tls_cert, PEM, unencrypted",
            example='"/etc/chunkd/s3-front.key"',
        ),
    )

    def __post_init__(self) -> None:
        normalize(self, S3_FRONT.keys, "S3FrontConfig")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "[s3_front] tls_cert and tls_key go together; set both for HTTPS, or neither"
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "[s3_front] access_key_id and secret_access_key go together; set both or neither"
            )

    @property
    def enabled(self) -> bool:
        """Whether the node serves the S3 front."""
        return self.listen is not None

    @property
    def host(self) -> str:
        """The host of :attr:`listen`."""
        return split_listen(self.listen or "")[0]

    @property
    def port(self) -> int:
        """The port of :attr:`listen`."""
        return split_listen(self.listen or "")[1]


@dataclass(frozen=True)
class JobsConfig:
    """The ``[jobs]`` section: the bounds of the per-job stall figures. Every field has
    the default shown."""

    top: int = field(
        default=16,
        metadata=key(
            COUNT,
            "jobs named in /metrics at once (train_job label); a job starting while this many "
            "are named is other for its whole life on this node",
        ),
    )
    worst_ranks: int = field(
        default=3,
        metadata=key(COUNT, "ranks per job shown as chunkd_loader_worst_rank_wait_ratio"),
    )
    idle: float = field(
        default=600.0,
        metadata=key(POSITIVE_DURATION, "a job this node has heard nothing of this long has ended"),
    )
    tracked: int = field(
        default=1024,
        metadata=key(
            POSITIVE_COUNT,
            "jobs (named or other) one node keeps; past it a new job is other and not kept "
            "by name (nor in the cost ledger)",
        ),
    )

    def __post_init__(self) -> None:
        normalize(self, JOBS.keys, "JobsConfig")


@dataclass(frozen=True)
class CostConfig:
    """The ``[cost]`` section's own keys (its price tables are ``[cost.NAME]``:
    :class:`PriceTable`). Every field has the default shown."""

    default: str = field(
        default="example-s3-in-region",
        metadata=key(
            TEXT,
            "the price table of a backend without price (file:// and memory:// backends: "
            "free); a table of [cost] or a shipped one",
        ),
    )
    names: int = field(
        default=64,
        metadata=key(
            POSITIVE_COUNT,
            "dataset and checkpoint names labelled in /metrics at once; the rest are other",
        ),
    )

    def __post_init__(self) -> None:
        normalize(self, COST.keys, "CostConfig")


@dataclass(frozen=True)
class PriceTable:
    """One ``[cost.NAME]`` price table, in the units of the big clouds' price sheets.

    A GB is 2^30 bytes. The amounts are in ``currency`` (every shipped table: USD).
    The shipped tables (:data:`SHIPPED_PRICES`) are examples, not facts about anyone's
    bill: write your own from your provider's sheet.
    """

    egress_per_gb: float = field(
        metadata=key(PRICE, "required: per GB (2^30 bytes) read out of the backend", example="0.09")
    )
    get_per_1000: float = field(
        metadata=key(PRICE, "required: per 1000 GET or HEAD requests", example="0.0004")
    )
    put_per_1000: float = field(
        metadata=key(PRICE, "required: per 1000 PUT or LIST requests", example="0.005")
    )
    storage_per_gb_month: float = field(
        metadata=key(PRICE, "required: per GB (2^30 bytes) kept for a month", example="0.023")
    )
    delete_per_1000: float = field(
        default=0.0, metadata=key(PRICE, "per 1000 DELETE requests (free on S3 and GCS)")
    )
    currency: str = field(
        default="USD", metadata=key(TEXT, "what the amounts are in; shown beside them")
    )

    def __post_init__(self) -> None:
        normalize(self, PRICE_TABLE.keys, "PriceTable")

    def charges(self) -> bool:
        """Whether any of its prices is above zero (a free table has no currency to
        disagree with another's)."""
        return any(
            price > 0
            for price in (
                self.egress_per_gb,
                self.get_per_1000,
                self.put_per_1000,
                self.storage_per_gb_month,
                self.delete_per_1000,
            )
        )


#: schemes whose backends default to the "free" table (local files, memory)
_FREE_SCHEMES: Final = ("file", "memory")


@dataclass(frozen=True)
class BackendConfig:
    """One ``[[backends]]`` table. Every field but ``name`` and ``url`` has the default shown.

    Fields are checked when the object is made, each alone and together (credentials
    go in pairs; a file or memory backend takes no endpoint); a bad value raises
    :class:`~chunkd.errors.ConfigError`.
    """

    name: str = field(
        metadata=key(
            NAME,
            "required: [a-z0-9][a-z0-9_-]{0,62}; users name objects NAME/KEY",
            example='"data"',
        )
    )
    url: str = field(
        metadata=key(
            URL,
            "required: s3://BUCKET[/PREFIX], gs://..., az://..., file:///ABSOLUTE/DIR, "
            "memory:// or https://HOST[/PATH] (read-only)",
            example='"s3://bucket/prefix"',
        )
    )
    endpoint: str | None = field(
        default=None,
        metadata=key(
            ENDPOINT,
            "the service's URL: an S3-compatible server, the GCS JSON API base, or an Azure "
            "blob endpoint with the account in its path (Azurite); unset: the provider's own",
            example='"https://minio:9000"',
        ),
    )
    region: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "s3:// only: the bucket's region; unset: the client library's default",
            example='"eu-west-1"',
        ),
    )
    access_key_id: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "s3://: the access key id, with secret_access_key; az://: the storage account "
            "(alone: its key from the machine); unset: the machine's credentials",
            example='"AKIA..."',
        ),
    )
    secret_access_key: Secret | None = field(
        default=None,
        metadata=key(
            SECRET,
            "s3://: the secret key; az://: the account key; never logged, shown as *** in "
            "/v1/stats",
            example='"..."',
        ),
    )
    session_token: Secret | None = field(
        default=None,
        metadata=key(
            SECRET, "s3:// only: for temporary credentials, with the two above", example='"..."'
        ),
    )
    credentials_file: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "a credentials file; for gs:// a service-account JSON key file (a relative path "
            "starts from the working directory); unset: the machine's credentials",
            example='"/etc/chunkd/gcs-service-account.json"',
        ),
    )
    allow_http: bool = field(
        default=False, metadata=key(BOOL, "allow a plain http:// endpoint (or http:// url)")
    )
    immutable_files: bool = field(
        default=False,
        metadata=key(
            BOOL,
            "http(s):// only: the server's files never change, so one without a strong ETag is "
            "read with size and Last-Modified as the version (refused otherwise)",
        ),
    )
    writable: bool = field(
        default=False, metadata=key(BOOL, "checkpoints and other writes may go to this backend")
    )
    revalidate: float | None = field(
        default=None,
        metadata=key(
            REVALIDATE,
            '"immutable" (a version once seen is never re-checked), or a duration: re-check an '
            "object's version after that long",
        ),
    )
    timeout: float = field(
        default=30.0,
        metadata=key(
            POSITIVE_DURATION,
            "a read fails when the backend is silent this long (a slow, steady body is not cut "
            "off); writes, HEADs and lists must end within it",
        ),
    )
    retries: int = field(default=3, metadata=key(COUNT, "retries of a failed backend request"))
    list_revalidate: float = field(
        default=30.0,
        metadata=key(
            DURATION,
            "a listing is answered from the daemon's memory this long (a folder gains shards); "
            "0: never",
        ),
    )
    price: str | None = field(
        default=None,
        metadata=key(
            TEXT,
            "the [cost] price table this backend's requests and bytes are priced by; unset: "
            "[cost] default (file:// and memory:// backends: free)",
            example='"example-s3-internet"',
        ),
    )
    stale_if_error: float = field(
        default=86400.0,
        metadata=key(
            DURATION,
            "with revalidate a duration: a cached object whose version cannot be re-checked is "
            "still served this long after its last check, marked stale (RFC 5861); 0: never",
        ),
    )

    def __post_init__(self) -> None:
        source = f"BackendConfig {self.name!r}"
        normalize(self, BACKENDS.keys, source)
        backend_rules(
            {f.name: getattr(self, f.name) for f in fields(self)},
            lambda name: where_from(source, name),
        )

    @property
    def scheme(self) -> str:
        """The URL scheme: ``"s3"``, ``"gs"``, ``"az"``, ``"file"``, ``"memory"``,
        ``"http"`` or ``"https"``."""
        return self.url.partition("://")[0]

    @property
    def kind(self) -> BackendKind:
        """The backend's kind, as it declares itself (:mod:`chunkd.gateway.config.kinds`)."""
        kind = kind_of(self.scheme)
        assert kind is not None  # the URL was checked
        return kind

    @property
    def bucket(self) -> str | None:
        """The bucket (or container) of an s3, gs or az URL; None for the kinds without."""
        return self.kind.bucket(self.url)

    @property
    def prefix(self) -> str:
        """Where keys start inside the backend, as its kind reads the URL.

        For s3, gs, az, http(s) and memory the URL path without leading or trailing
        slashes (``""`` for a whole bucket); for file the absolute directory, taken
        literally (no percent-decoding).
        """
        return self.kind.prefix(self.url)

    @property
    def immutable(self) -> bool:
        """Whether object versions are never re-checked (``revalidate`` is None)."""
        return self.revalidate is None


_CACHE_DEFAULTS: Final = {f.name: f.default for f in fields(CacheConfig)}


def _cache_key(name: str, kind: Kind, doc: str, *, default: Any = MISSING) -> Key:
    """A ``[cache]`` key: a field of CacheConfig, whose default it takes unless given."""
    return Key(name, name, kind, doc, _CACHE_DEFAULTS[name] if default is MISSING else default)


#: CacheConfig fields that are not keys, and why
NOT_CACHE_KEYS: Final = {
    "reconcile": "off only where a benchmark times the open itself; a daemon always sweeps "
    "its disk tier against the index after opening, or it would keep what a crash orphaned",
}


SERVER: Final = Section(
    "server",
    "[server]",
    "the HTTP listener, the local socket, logs and reads",
    keys_of(ServerConfig),
)
CACHE: Final = Section(
    "cache",
    "[cache]",
    "the node's chunk cache: RAM over local disk, with an lmdb index",
    {
        k.name: k
        for k in (
            _cache_key(
                "dir",
                PATH,
                "index/, chunks/, tmp/ and LOCK live here",
                default=Path("/var/cache/chunkd"),
            ),
            _cache_key("ram_bytes", SIZE, "RAM tier budget (sealed memfds)"),
            _cache_key("disk_bytes", SIZE, "disk tier budget (stored bytes, after compression)"),
            _cache_key(
                "disk_min_free_bytes", SIZE, "free space the disk tier leaves on its filesystem"
            ),
            _cache_key("chunk_bytes", CHUNK_SIZE, "chunk size; a multiple of the page size"),
            _cache_key("fsync", enum_of(FsyncPolicy), '"always" or "never"'),
            _cache_key("compress", BOOL, "zstd on disk when it saves at least 1/8"),
            _cache_key("verify_reads", BOOL, "check every chunk read from disk against its id"),
            _cache_key(
                "write_policy",
                enum_of(WritePolicy),
                '"write-through", "write-behind" or "upper-only"',
            ),
            _cache_key(
                "eviction",
                choice("s3fifo", "lru"),
                'RAM eviction: "s3fifo" (scan-resistant) or "lru"',
            ),
            _cache_key("disk_workers", POSITIVE_COUNT, "threads for the disk tier's file I/O"),
            _cache_key(
                "index_flush_interval",
                POSITIVE_DURATION,
                "most an index write waits to be committed with others in one transaction",
            ),
            _cache_key(
                "disk_retry_after",
                POSITIVE_DURATION,
                "how long the disk tier stops writing after ENOSPC or EIO (reads go on)",
            ),
        )
    },
)
PEERS: Final = Section(
    "peers",
    "[peers]",
    "other chunkd nodes to share chunks with; without self this node is on its own",
    keys_of(PeersConfig),
    commented=True,
)
DATASETS: Final = Section(
    "datasets",
    "[datasets]",
    "the dataset registry: named, versioned snapshots (docs/datasets.md)",
    keys_of(DatasetsConfig),
)
S3_FRONT: Final = Section(
    "s3_front",
    "[s3_front]",
    "an S3-compatible endpoint: the backends as buckets, for unchanged S3 clients (docs/s3.md)",
    keys_of(S3FrontConfig),
    commented=True,
)
JOBS: Final = Section(
    "jobs",
    "[jobs]",
    "training jobs: how many are named in the per-job stall and cost figures (docs/jobs.md)",
    keys_of(JobsConfig),
)
COST: Final = Section(
    "cost",
    "[cost]",
    "what data movement costs: the default price table and the names labelled (docs/jobs.md)",
    keys_of(CostConfig),
)
#: a ``[cost.NAME]`` table (any number of them; not in :data:`SECTIONS`, which are the
#: sections of one name each)
PRICE_TABLE: Final = Section(
    "cost.NAME",
    "[cost.my-prices]",
    "a price table [cost.NAME] (here NAME is my-prices), for [cost] default and "
    "[[backends]] price; shipped: free, example-s3-in-region, example-s3-internet, "
    "example-gcs-internet (examples, not facts about anyone's bill); a GB is 2^30 bytes",
    keys_of(PriceTable),
)
#: the price tables every daemon knows; examples, not facts about anyone's bill (the
#: list prices of AWS S3 Standard and GCS Standard in us-east-1 / us multi-region as
#: published in 2024); a [cost.NAME] of the same name replaces one
SHIPPED_PRICES: Final[Mapping[str, PriceTable]] = {
    "free": PriceTable(0.0, 0.0, 0.0, 0.0),
    "example-s3-in-region": PriceTable(0.0, 0.0004, 0.005, 0.023),
    "example-s3-internet": PriceTable(0.09, 0.0004, 0.005, 0.023),
    "example-gcs-internet": PriceTable(0.12, 0.0004, 0.005, 0.026),
}

BACKENDS: Final = Section(
    "backends", "[[backends]]", "one table per backend; at least one", keys_of(BackendConfig)
)
#: every section, in the order the docs list them
SECTIONS: Final = (SERVER, CACHE, PEERS, DATASETS, S3_FRONT, JOBS, COST, BACKENDS)
#: the sections the docs list, with the price tables after [cost]
DOC_SECTIONS: Final = (SERVER, CACHE, PEERS, DATASETS, S3_FRONT, JOBS, COST, PRICE_TABLE, BACKENDS)


# -- the whole config ---------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The whole configuration of one daemon. Build it with :func:`load_config`."""

    #: the [server] section
    server: ServerConfig
    #: the [cache] section (dir defaults to /var/cache/chunkd in a file)
    cache: CacheConfig
    #: the [[backends]], in file order; also the allowlist of reachable backends
    backends: tuple[BackendConfig, ...]
    #: the file it was read from, or "embedded default"
    source: str
    #: the [peers] section (disabled when absent)
    peers: PeersConfig = PeersConfig()
    #: the [datasets] section
    datasets: DatasetsConfig = DatasetsConfig()
    #: the [s3_front] section (disabled when absent)
    s3_front: S3FrontConfig = S3FrontConfig()
    #: the [jobs] section
    jobs: JobsConfig = JobsConfig()
    #: the [cost] section's own keys
    cost: CostConfig = CostConfig()
    #: the price tables by name: the shipped ones, and the [cost.NAME] tables over them
    prices: Mapping[str, PriceTable] = field(default_factory=lambda: dict(SHIPPED_PRICES))

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", tuple(self.backends))
        seen: set[str] = set()
        for backend in self.backends:
            if backend.name in seen:
                raise ConfigError(
                    f"{self.source}: backend name {backend.name!r} is used twice; "
                    "give each backend its own name"
                )
            seen.add(backend.name)
        tables = ", ".join(sorted(self.prices))
        if self.cost.default not in self.prices:
            raise ConfigError(
                f"{self.source}: [cost] default = {self.cost.default!r} names no price table "
                f"(the tables: {tables}); add a [cost.{self.cost.default}] table or name one "
                "of those"
            )
        for backend in self.backends:
            if backend.price is not None and backend.price not in self.prices:
                raise ConfigError(
                    f"{self.source}: [[backends]] {backend.name!r} price = {backend.price!r} "
                    f"names no price table (the tables: {tables}); add a "
                    f"[cost.{backend.price}] table or name one of those"
                )
        # Every amount the ledger adds up must be in one currency: a sum of USD and EUR
        # is no figure. A table that charges nothing has no currency to disagree with.
        used: dict[str, set[str]] = {}
        for table_name in {self.cost.default, *(self.price_of(b) for b in self.backends)}:
            table = self.prices[table_name]
            if table.charges():
                used.setdefault(table.currency, set()).add(table_name)
        if len(used) > 1:
            mixed = "; ".join(
                f"{currency}: {', '.join(sorted(names))}"
                for currency, names in sorted(used.items())
            )
            raise ConfigError(
                f"{self.source}: the price tables in use are in different currencies ({mixed}); "
                "the cost ledger adds their amounts up, so give every table [cost] default "
                "and the backends use one currency"
            )

    def price_of(self, backend: BackendConfig) -> str:
        """The name of the price table ``backend`` is priced by."""
        if backend.price is not None:
            return backend.price
        return "free" if backend.scheme in _FREE_SCHEMES else self.cost.default

    def backend(self, name: str) -> BackendConfig | None:
        """The backend called ``name``, or None if there is none."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        return None

    def redacted(self) -> dict[str, Any]:
        """A JSON-able view for ``/v1/stats`` and logs, with nothing secret in it.

        Every :class:`Secret` shows as ``"***"`` (an unset one as None). An
        ``access_key_id``, a backend's and ``[s3_front]``'s alike, shows as the AWS CLI
        shows it, sixteen ``*`` and its last four characters
        (``"****************WXYZ"``; only the stars for a key of eight characters or
        fewer): enough to tell which key is in use, not to use
        it. Paths and enums are strings, ``socket_mode`` is octal text like ``"0660"``
        and a ``revalidate`` of None is ``"immutable"``, as one would write them in
        TOML.
        """
        server = _plain(self.server)
        server["socket_mode"] = f"{self.server.socket_mode:04o}"
        backends = []
        for backend in self.backends:
            view = _plain(backend)
            if backend.revalidate is None:
                view["revalidate"] = "immutable"
            if backend.access_key_id is not None:
                view["access_key_id"] = _masked_key_id(backend.access_key_id)
            backends.append(view)
        front = _plain(self.s3_front)
        if self.s3_front.access_key_id is not None:
            front["access_key_id"] = _masked_key_id(self.s3_front.access_key_id)
        return {
            "source": self.source,
            "server": server,
            "cache": _plain(self.cache),
            "backends": backends,
            "peers": _plain(self.peers),
            "datasets": _plain(self.datasets),
            "s3_front": front,
            "jobs": _plain(self.jobs),
            "cost": {
                **_plain(self.cost),
                "tables": {name: _plain(table) for name, table in sorted(self.prices.items())},
            },
        }


def _masked_key_id(key_id: str) -> str:
    """An access key id as the AWS CLI shows it: sixteen ``*`` and its last four
    characters, only the stars for a key of eight characters or fewer."""
    return "*" * 16 + (key_id[-4:] if len(key_id) > 8 else "")


def _plain(obj: object) -> dict[str, Any]:
    return {f.name: _jsonable(getattr(obj, f.name)) for f in fields(obj)}  # type: ignore[arg-type]


def _jsonable(value: object) -> Any:
    if isinstance(value, Secret):
        return "***"
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, Enum):
        return _jsonable(value.value)
    if isinstance(value, str | Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(value)
    return str(value)
