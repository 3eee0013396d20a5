"""What one backend request or byte costs, by the backend's price table
(``[cost.NAME]``, :class:`~chunkd.gateway.config.PriceTable`).

A GB is 2^30 bytes. GET and HEAD pay ``get_per_1000``; PUT and LIST pay
``put_per_1000``; DELETE pays ``delete_per_1000``. Egress is paid on bytes read out
of the backend only (writes into a bucket are free on the big clouds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from chunkd.gateway.config.schema import SHIPPED_PRICES, PriceTable

__all__ = ["GB", "OPS", "Prices"]

#: the GB of every price: 2^30 bytes
GB: Final = 1 << 30
#: the request kinds the ledger counts (``chunkd_backend_requests_total``'s ``op``)
OPS: Final = ("get", "head", "put", "list", "delete")


class Prices:
    """The price table of each backend.

    Args:
        tables: the price tables by name (the shipped ones and the config's).
        backend_prices: the table name of each backend by backend name; a backend not
            in it (or a table not in ``tables``) is priced by ``default``.
        default: the table of a backend not named in ``backend_prices``.
    """

    def __init__(
        self,
        tables: Mapping[str, PriceTable] = SHIPPED_PRICES,
        backend_prices: Mapping[str, str] | None = None,
        default: str = "free",
    ) -> None:
        self.tables = dict(tables)
        self.backend_prices = dict(backend_prices or {})
        self.default = default

    def table(self, backend: str) -> PriceTable:
        """The price table of ``backend``."""
        name = self.backend_prices.get(backend, self.default)
        return self.tables.get(name) or self.tables.get(self.default) or SHIPPED_PRICES["free"]

    @property
    def currency(self) -> str:
        """The currency of the amounts: that of the tables in use that charge anything
        (the config refuses tables in use in different currencies), else the default
        table's (every shipped table's: USD)."""
        for name in (self.default, *sorted(set(self.backend_prices.values()))):
            table = self.tables.get(name)
            if table is not None and table.charges():
                return table.currency
        return self.table("").currency

    def request(self, backend: str, op: str) -> float:
        """The fee of one request ``op`` (get, head, put, list, delete) to ``backend``."""
        table = self.table(backend)
        if op in ("get", "head"):
            return table.get_per_1000 / 1000
        if op == "delete":
            return table.delete_per_1000 / 1000
        return table.put_per_1000 / 1000

    def egress(self, backend: str, n: int) -> float:
        """What reading ``n`` bytes out of ``backend`` costs."""
        return n / GB * self.table(backend).egress_per_gb

    def storage(self, backend: str, n: int) -> float:
        """What keeping ``n`` bytes in ``backend`` costs a month."""
        return n / GB * self.table(backend).storage_per_gb_month
