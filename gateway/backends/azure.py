"""``az://container/prefix``: Azure Blob Storage (or Azurite).

Config keys, as they apply here:

- ``access_key_id``: the storage account's name (obstore's ``account_name``);
- ``secret_access_key``: the account's shared key (``account_key``, base64);
- ``endpoint``: the account's blob endpoint, over
  ``https://{account}.blob.core.windows.net``. For Azurite, or any endpoint that
  names the account in its path, give the path too:
  ``http://127.0.0.1:10000/devstoreaccount1`` (with ``allow_http = true``);
- none of them: the machine's credentials (``AZURE_STORAGE_*`` environment, managed
  identity, the Azure CLI).

``region`` is not used (the account's endpoint says where it is), and a
``session_token`` is refused: Azure has none (a SAS goes in the environment,
``AZURE_STORAGE_SAS_KEY``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from obstore.store import AzureStore

from chunkd.gateway.backends.store import StoreBackend, cloud_store

if TYPE_CHECKING:
    from obstore.store import AzureConfig

    from chunkd.gateway.config import BackendConfig

__all__ = ["AzureBackend"]

#: blob names are at most 1024 characters, the prefix included
_NAME_CHARS: Final = 1024


class AzureBackend(StoreBackend):
    """An Azure Blob Storage container (or a prefix of one)."""

    @classmethod
    def make_store(cls, config: BackendConfig) -> Any:
        # docstring inherited
        settings: AzureConfig = {}
        if config.access_key_id:
            settings["account_name"] = config.access_key_id
        if config.secret_access_key is not None:
            settings["account_key"] = config.secret_access_key.reveal()
        if config.endpoint:
            settings["endpoint"] = config.endpoint
        return cloud_store(AzureStore, config, config=settings)

    def name_limit(self, name: str) -> tuple[str, int, int, str] | None:
        # docstring inherited
        return "Azure blob names", _NAME_CHARS, len(name), "characters"
