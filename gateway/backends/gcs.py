"""``gs://bucket/prefix``: Google Cloud Storage (or fake-gcs-server).

Config keys, as they apply here:

- ``credentials_file``: a service-account JSON file (obstore's ``service_account``).
  Its ``gcs_base_url`` and ``disable_oauth`` fields point the backend at an emulator,
  as object_store's own CI does with fake-gcs-server.
- ``endpoint``: the JSON API's base URL (obstore's ``base_url``), over the one the
  credentials name; ``http://`` needs ``allow_http = true``.
- none of them: the machine's credentials (``GOOGLE_*`` environment, application
  default credentials, the metadata server).

``region`` is not used (a bucket has its location; the client names none), and
Cloud Storage has no access key pair on its JSON API: ``access_key_id``,
``secret_access_key`` and ``session_token`` are refused (HMAC keys belong to its S3
interoperability endpoint: use ``s3://`` with ``endpoint =
"https://storage.googleapis.com"`` for them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from obstore.store import GCSStore

from chunkd.gateway.backends.store import StoreBackend, cloud_store

if TYPE_CHECKING:
    from obstore.store import GCSConfig

    from chunkd.gateway.config import BackendConfig

__all__ = ["GCSBackend"]

#: Cloud Storage object names are at most 1024 bytes of UTF-8, the prefix included
_NAME_BYTES: Final = 1024


class GCSBackend(StoreBackend):
    """A Cloud Storage bucket (or a prefix of one)."""

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
        settings: GCSConfig = {}
        if config.credentials_file:
            settings["service_account"] = config.credentials_file
        if config.endpoint:
            settings["base_url"] = config.endpoint
        return cloud_store(GCSStore, config, config=settings)

    def name_limit(self, name: str) -> tuple[str, int, int, str] | None:
        # docstring inherited
        size = len(name.encode("utf-8", "surrogatepass"))
        return "Cloud Storage names", _NAME_BYTES, size, "bytes"
