"""The daemon's configuration: one TOML file, with ``CHUNKD_*`` environment overrides.

``chunkd serve --config /etc/chunkd/chunkd.toml`` reads the file with
:func:`load_config`; ``chunkd serve`` with no file runs on :func:`embedded_default`.
Config is data: frozen dataclasses, read once at start-up.

* :mod:`~chunkd.gateway.config.values`: sizes, durations, :class:`Secret`, and the
  kinds of value a key holds (how each is read, and written back as TOML);
  :mod:`~chunkd.gateway.config.addresses`: ``host:port``, backend URLs, endpoints.
* :mod:`~chunkd.gateway.config.schema`: the frozen dataclasses, and every key declared
  once (name, kind, default, one line of documentation).
* :mod:`~chunkd.gateway.config.load`: the TOML file, the embedded default and the
  ``CHUNKD_*`` environment (the only module that reads the environment for
  configuration).
* :mod:`~chunkd.gateway.config.doc`: the reference below and the key tables of
  ``docs/config.md``, generated from the declarations
  (``python -m chunkd.gateway.config.doc --write``).

Every key, with its default (a key left out takes the default)::

    # the HTTP listener, the local socket, logs and reads
    [server]
    # HTTP listener, host:port; IPv6 as "[::1]:8470", "0.0.0.0:8470" for every interface
    listen = "127.0.0.1:8470"
    # local socket for the trainers of this node
    socket = "/run/chunkd/chunkd.sock"
    # its permissions: a string "0660" or TOML octal 0o660 (a plain integer is a number)
    socket_mode = "0660"
    # group owning the socket, a name or a numeric GID; unset: the daemon's own
    # socket_group = "train"
    # group, a name or a numeric GID, whose members may change and delete every user's
    # checkpoints and datasets on the local socket, as root and the daemon's own user may
    # (docs/security.md); unset: none
    # admin_group = "chunkd-admin"
    # local socket connections served at once; more wait to be accepted (a dropped one
    # still counts until its client reads or closes what it was sent)
    socket_max_clients = 1024
    # a local client whose socket takes no bytes this long, or that asks again and leaves
    # an answer with fds unread this long, is dropped (a stuck reader;
    # chunkd_local_stuck_clients_total)
    socket_send_timeout = "30s"
    # how long a stop waits for requests in flight
    shutdown_timeout = "10s"
    # HTTP port and S3 front: a new connection's first request head (and its TLS
    # handshake), or a later head from its first byte, must arrive whole within this; else
    # the connection is closed
    header_timeout = "10s"
    # HTTP port and S3 front: a kept-alive connection that starts no next request within
    # this is closed
    idle_timeout = "1m"
    # HTTP port and S3 front: a request body must arrive whole within this of its head;
    # else the connection is closed
    body_timeout = "1m"
    # connections from non-peers, both ports together (at most a quarter of the fd limit);
    # past it the one idle longest is closed, or the new one (docs/security.md)
    max_connections = 1024
    # of those, from one client address (loopback has no cap of its own)
    max_connections_per_address = 128
    # connections from [peers] members' addresses: a budget of their own that non-peers
    # cannot take (at most a quarter of the fd limit)
    peer_connections = 1024
    # "json" (one object a line) or "text"
    log_format = "json"
    # "debug", "info", "warning", "error" or "critical"
    log_level = "info"
    # shared secret non-loopback clients send as 'Authorization: Bearer TOKEN' on data
    # routes; unset: they get 403 (never a proxy)
    # token = "..."
    # objects loaded at once for prefetch and warm, all clients together
    prefetch_in_flight = 64
    # of those, at once for one client (a user id of the node)
    prefetch_per_client = 8
    # chunks read ahead of a sequential reader, past the one it reads; 0: none
    readahead_chunks = 4
    # most chunks one backend GET fetches for a run of cold chunks
    span_chunks = 64
    # processes that decode files for the inspector (Parquet, tar, MDS); the daemon itself
    # never decodes
    inspect_workers = 2
    # most one inspector request may take; its worker is killed after
    inspect_timeout = "10s"
    # address space of each inspector worker; past it the request fails
    inspect_memory = "2GiB"

    # the node's chunk cache: RAM over local disk, with an lmdb index
    [cache]
    # index/, chunks/, tmp/ and LOCK live here
    dir = "/var/cache/chunkd"
    # RAM tier budget (sealed memfds)
    ram_bytes = "8GiB"
    # disk tier budget (stored bytes, after compression)
    disk_bytes = "200GiB"
    # free space the disk tier leaves on its filesystem
    disk_min_free_bytes = "1GiB"
    # chunk size; a multiple of the page size
    chunk_bytes = "4MiB"
    # "always" or "never"
    fsync = "always"
    # zstd on disk when it saves at least 1/8
    compress = true
    # check every chunk read from disk against its id
    verify_reads = true
    # "write-through", "write-behind" or "upper-only"
    write_policy = "write-through"
    # RAM eviction: "s3fifo" (scan-resistant) or "lru"
    eviction = "s3fifo"
    # threads for the disk tier's file I/O
    disk_workers = 4
    # most an index write waits to be committed with others in one transaction
    index_flush_interval = "50ms"
    # how long the disk tier stops writing after ENOSPC or EIO (reads go on)
    disk_retry_after = "30s"

    # other chunkd nodes to share chunks with; without self this node is on its own
    [peers]
    # this node's address (host:port), as the others reach it; unset: no peers
    # self = "10.0.0.7:8470"
    # a static list of host:port (self may be in it), each maybe with labels after it:
    # rack is its failure domain for replicas
    # members = []
    # a file of members, one host:port and its labels (rack: the failure domain) a line
    # ('#' comments), re-read when it changes
    # members_file = "/etc/chunkd/peers"
    # name:port whose A/AAAA records are the members, re-resolved every health_interval
    # dns = "chunkd.train.svc:8470"
    # the file holding the shared secret every peer request carries (needed with self)
    # token_file = "/etc/chunkd/token"
    # a peer silent this long is probed, and skipped if the probe fails; also the connect
    # timeout
    # timeout = "2s"
    # most one request to a peer may take in all, however healthy the peer stays
    # request_timeout = "2m"
    # how often each peer's /healthz is probed
    # health_interval = "1s"
    # failed probes in a row before a peer is marked down
    # down_after = 3
    # passed probes in a row before a down peer is up again
    # up_after = 2
    # chunk requests this node has in flight to any one peer; a restore pipelines its
    # chunks over several owners and holders at once within it
    # per_peer_requests = 4
    # copies of one chunk a node sends to other nodes before the chunk's owner sends
    # further askers to nodes that hold it (holders serve)
    # holder_fanout = 4
    # how long a chunk's owner remembers which nodes hold it
    # holder_ttl = "10m"
    # peers (in other failure domains) whose RAM gets a copy of each save's chunks, unless
    # the save names its own count (async_save replicas); 0: none
    # replicas = 0
    # RAM this node gives to other nodes' replicas; a push past it is refused (the saver's
    # save completes with fewer replicas, counted)
    # replica_budget = "1GiB"
    # TLS (all three tls_ keys, or none): this node's certificate chain, PEM, its SANs
    # naming the host of self; the HTTP port then serves HTTPS only
    # tls_cert = "/etc/chunkd/node.pem"
    # the private key of tls_cert, PEM, unencrypted (chmod 600)
    # tls_key = "/etc/chunkd/node.key"
    # the CA(s), PEM, peers' certificates (server and client) must chain to
    # tls_ca = "/etc/chunkd/ca.pem"

    # the dataset registry: named, versioned snapshots (docs/datasets.md)
    [datasets]
    # BACKEND/PREFIX of a writable backend where dataset snapshots, their versions, tags
    # and frozen chunks live; every node with the same registry sees the same names
    registry = "local/datasets"
    # decoded dataset units the daemon holds for its readers, as sealed memfds of Arrow
    # IPC (docs/decoding.md); the least recently used go past it; 0: the daemon decodes
    # nothing and readers decode in-process
    decoded_bytes = "1GiB"
    # processes that decode dataset units once per node for its readers; 0: none (readers
    # decode in-process)
    decode_workers = 2
    # most one unit's decode may take; its worker is killed after, and its readers decode
    # in-process
    decode_timeout = "1m"
    # address space of each decode worker; past it the decode fails, not the node
    decode_memory = "2GiB"

    # an S3-compatible endpoint: the backends as buckets, for unchanged S3 clients
    # (docs/s3.md)
    [s3_front]
    # the S3 endpoint's own host:port, what AWS_ENDPOINT_URL names; unset: no front
    # listen = "127.0.0.1:8471"
    # a file of access keys, 'ACCESS_KEY_ID SECRET' a line ('#' comments), chmod 600
    # keys_file = "/etc/chunkd/s3-front.keys"
    # one more access key, with secret_access_key (both from the environment, say)
    # access_key_id = "chunkd"
    # the secret of access_key_id (CHUNKD_S3_FRONT_SECRET_ACCESS_KEY)
    # secret_access_key = "..."
    # answer unsigned requests from this host (never from another)
    # unsigned_from_loopback = false
    # most a signed request's time may differ from this node's clock (S3's 15 minutes)
    # max_skew = "15m"
    # also take SigV2 signatures (boto3's default presigned URLs); false: SigV4 only
    # sigv2 = true
    # the region GetBucketLocation and HeadBucket answer
    # region = "us-east-1"
    # HTTPS (with tls_key): the front's certificate chain, PEM; clients get its CA
    # (AWS_CA_BUNDLE)
    # tls_cert = "/etc/chunkd/s3-front.pem"
    # the private key of tls_cert, PEM, unencrypted
    # tls_key = "/etc/chunkd/s3-front.key"

    # training jobs: how many are named in the per-job stall and cost figures
    # (docs/jobs.md)
    [jobs]
    # jobs named in /metrics at once (train_job label); a job starting while this many are
    # named is other for its whole life on this node
    top = 16
    # ranks per job shown as chunkd_loader_worst_rank_wait_ratio
    worst_ranks = 3
    # a job this node has heard nothing of this long has ended
    idle = "10m"
    # jobs (named or other) one node keeps; past it a new job is other and not kept by
    # name (nor in the cost ledger)
    tracked = 1024

    # what data movement costs: the default price table and the names labelled
    # (docs/jobs.md)
    [cost]
    # the price table of a backend without price (file:// and memory:// backends: free); a
    # table of [cost] or a shipped one
    default = "example-s3-in-region"
    # dataset and checkpoint names labelled in /metrics at once; the rest are other
    names = 64

    # a price table [cost.NAME] (here NAME is my-prices), for [cost] default and
    # [[backends]] price; shipped: free, example-s3-in-region, example-s3-internet,
    # example-gcs-internet (examples, not facts about anyone's bill); a GB is 2^30 bytes
    [cost.my-prices]
    # required: per GB (2^30 bytes) read out of the backend
    egress_per_gb = 0.09
    # required: per 1000 GET or HEAD requests
    get_per_1000 = 0.0004
    # required: per 1000 PUT or LIST requests
    put_per_1000 = 0.005
    # required: per GB (2^30 bytes) kept for a month
    storage_per_gb_month = 0.023
    # per 1000 DELETE requests (free on S3 and GCS)
    delete_per_1000 = 0.0
    # what the amounts are in; shown beside them
    currency = "USD"

    # one table per backend; at least one
    [[backends]]
    # required: [a-z0-9][a-z0-9_-]{0,62}; users name objects NAME/KEY
    name = "data"
    # required: s3://BUCKET[/PREFIX], gs://..., az://..., file:///ABSOLUTE/DIR, memory://
    # or https://HOST[/PATH] (read-only)
    url = "s3://bucket/prefix"
    # the service's URL: an S3-compatible server, the GCS JSON API base, or an Azure blob
    # endpoint with the account in its path (Azurite); unset: the provider's own
    # endpoint = "https://minio:9000"
    # s3:// only: the bucket's region; unset: the client library's default
    # region = "eu-west-1"
    # s3://: the access key id, with secret_access_key; az://: the storage account (alone:
    # its key from the machine); unset: the machine's credentials
    # access_key_id = "AKIA..."
    # s3://: the secret key; az://: the account key; never logged, shown as *** in
    # /v1/stats
    # secret_access_key = "..."
    # s3:// only: for temporary credentials, with the two above
    # session_token = "..."
    # a credentials file; for gs:// a service-account JSON key file (a relative path
    # starts from the working directory); unset: the machine's credentials
    # credentials_file = "/etc/chunkd/gcs-service-account.json"
    # allow a plain http:// endpoint (or http:// url)
    allow_http = false
    # http(s):// only: the server's files never change, so one without a strong ETag is
    # read with size and Last-Modified as the version (refused otherwise)
    immutable_files = false
    # checkpoints and other writes may go to this backend
    writable = false
    # "immutable" (a version once seen is never re-checked), or a duration: re-check an
    # object's version after that long
    revalidate = "immutable"
    # a read fails when the backend is silent this long (a slow, steady body is not cut
    # off); writes, HEADs and lists must end within it
    timeout = "30s"
    # retries of a failed backend request
    retries = 3
    # a listing is answered from the daemon's memory this long (a folder gains shards); 0:
    # never
    list_revalidate = "30s"
    # the [cost] price table this backend's requests and bytes are priced by; unset:
    # [cost] default (file:// and memory:// backends: free)
    # price = "example-s3-internet"
    # with revalidate a duration: a cached object whose version cannot be re-checked is
    # still served this long after its last check, marked stale (RFC 5861); 0: never
    stale_if_error = "1d"

Relative paths (``socket``, ``dir``) are taken from the working directory when the
config is loaded. ``endpoint``, ``region``, the credentials and ``allow_http`` apply to
s3, gs and az backends (a file or memory backend ignores them); there
``access_key_id`` and ``secret_access_key`` go together, and an ``http://`` endpoint
needs ``allow_http = true``.

Sizes are a whole number of bytes or a string: ``"8GiB"``, ``"200 GiB"``,
``"512KiB"``, ``"1.5GiB"`` (binary units KiB, MiB, GiB, TiB, PiB; also Ki, Mi, Gi...),
``"10GB"`` (decimal units kB, MB, GB, TB, PB) or ``"123"`` (bytes). A bare ``"8G"`` is
refused as ambiguous. Durations are a number of seconds or a string: ``"250ms"``,
``"1.5s"``, ``"5m"``, ``"1h"``, ``"2d"``, ``"1h30m"``.

Environment overrides, applied on top of the file (or of the embedded default):

* ``CHUNKD_SERVER_<KEY>`` sets one key of ``[server]``: ``CHUNKD_SERVER_LISTEN=0.0.0.0:8470``.
* ``CHUNKD_CACHE_<KEY>`` sets one key of ``[cache]``: ``CHUNKD_CACHE_RAM_BYTES=16GiB``.
* ``CHUNKD_PEERS_<KEY>`` sets one key of ``[peers]``: ``CHUNKD_PEERS_TLS_CA=/etc/chunkd/ca.pem``.
* ``CHUNKD_DATASETS_<KEY>`` sets one key of ``[datasets]``:
  ``CHUNKD_DATASETS_REGISTRY=data/registry``.
* ``CHUNKD_S3_FRONT_<KEY>`` sets one key of ``[s3_front]``:
  ``CHUNKD_S3_FRONT_SECRET_ACCESS_KEY=...``.
* ``CHUNKD_BACKENDS_<NAME>_<KEY>`` sets one key of the backend named NAME (upper-cased,
  ``-`` written as ``_``): ``CHUNKD_BACKENDS_DATA_SECRET_ACCESS_KEY=...``.

KEY is the key upper-cased. Values go through the same parsing and checks as the
file's; booleans are ``true``/``false`` (also ``1``/``0``, ``yes``/``no``,
``on``/``off``). An empty value unsets a key whose default is unset (``socket_group``,
``endpoint``, ``region``, the credentials, the ``[peers]`` files and addresses, and
``revalidate``, which then means immutable). A variable under these prefixes that
names no key, or no configured backend, is an error; the environment can neither add
nor rename a backend. Other ``CHUNKD_*`` variables (``CHUNKD_SOCKET``, read by the
client) are not configuration and are left alone.
"""

from __future__ import annotations

from chunkd.gateway.config.load import embedded_default, load_config
from chunkd.gateway.config.schema import (
    BackendConfig,
    Config,
    DatasetsConfig,
    PeersConfig,
    S3FrontConfig,
    ServerConfig,
)
from chunkd.gateway.config.values import (
    Secret,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)

__all__ = [
    "BackendConfig",
    "Config",
    "DatasetsConfig",
    "PeersConfig",
    "S3FrontConfig",
    "Secret",
    "ServerConfig",
    "embedded_default",
    "format_duration",
    "format_size",
    "load_config",
    "parse_duration",
    "parse_size",
]
