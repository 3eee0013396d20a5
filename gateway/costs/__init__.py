"""Costs: who the work at hand is for (:mod:`.attribution`), and what data movement
cost, by job and by dataset or checkpoint name, priced by each backend's price table
(:mod:`.ledger`). docs/jobs.md is the user's side."""

from __future__ import annotations

from chunkd.gateway.costs.attribution import ATTRIBUTION, Attribution, account_name
from chunkd.gateway.costs.ledger import Ledger

__all__ = ["ATTRIBUTION", "Attribution", "Ledger", "account_name"]
