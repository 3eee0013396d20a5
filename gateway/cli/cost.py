"""``chunkd cost``: what data movement cost, by job: this node's ledger
(``GET /v1/cost``), or the cluster's figures from Prometheus (``--prometheus URL``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TextIO

from chunkd.errors import InvalidRequestError
from chunkd.gateway.cli.options import http_options, human_size
from chunkd.gateway.costs.since import parse_since
from chunkd.gateway.tls import cacert_context, unreachable

__all__ = ["add_parser", "prometheus_view", "run"]

#: the most rows a --prometheus query answers with that the table shows (topk)
MAX_JOBS_SHOWN = 200


def _get_json(url: str, context: Any) -> Any:
    with urllib.request.urlopen(url, timeout=15, context=context) as response:
        return json.loads(response.read())


def _window(since: str | None) -> str | None:
    """``since`` as a PromQL range (``3600s``), None for the counters' whole life."""
    if since is None:
        return None
    now = time.time()
    seconds = max(1, round(now - parse_since(since, now)))
    return f"{seconds}s"


def _queries(window: str | None) -> dict[str, str]:
    """The PromQL of each figure: raw metric expressions, no recording rule needed."""

    def total(metric: str, by: str) -> str:
        series = f"increase({metric}[{window}])" if window else metric
        return f"sum by ({by}) ({series})"

    return {
        "spent": total("chunkd_cost_dollars_total", "train_job"),
        "direct": total("chunkd_cost_direct_dollars_total", "train_job"),
        "saved": total("chunkd_cost_saved_dollars_total", "train_job, source"),
        "served_bytes": total("chunkd_cost_served_bytes_total", "train_job, source"),
        "backend_requests": total("chunkd_cost_backend_requests_total", "train_job, op"),
        "backend_bytes": total("chunkd_cost_backend_bytes_total", "train_job, direction"),
    }


def prometheus_view(base: str, since: str | None, job: str | None, context: Any) -> dict[str, Any]:
    """The cluster's figures from the Prometheus at ``base``, shaped as ``GET /v1/cost``
    answers (jobs by ``train_job`` label; money in the tables' currency)."""
    jobs: dict[str, dict[str, Any]] = {}
    for figure, query in _queries(_window(since)).items():
        url = f"{base.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        answer = _get_json(url, context)
        if answer.get("status") != "success":
            raise ValueError(f"Prometheus answered {answer.get('error', answer)!r} to {query}")
        for sample in answer["data"]["result"][: MAX_JOBS_SHOWN * 8]:
            labels = sample["metric"]
            name = labels.get("train_job", "none")
            value = float(sample["value"][1])
            row = jobs.setdefault(name, _empty(name))
            if figure in ("spent", "direct"):
                row[figure] += value
            else:
                part = labels.get("source") or labels.get("op") or labels.get("direction")
                row[figure][part] = row[figure].get(part, 0.0) + value
    rows = [row for name, row in jobs.items() if job is None or name == job]
    rows.sort(key=lambda r: -r["spent"] - r["direct"])
    totals = _empty("")
    for row in rows:
        for key in ("spent", "direct"):
            totals[key] += row[key]
        for key in ("saved", "served_bytes", "backend_requests", "backend_bytes"):
            for part, value in row[key].items():
                totals[key][part] = totals[key].get(part, 0.0) + value
    del totals["job"], totals["label"]
    now = time.time()
    return {
        "since": None if since is None else parse_since(since, now),
        "now": now,
        "currency": "USD",
        "source": "prometheus",
        "totals": totals,
        "jobs": rows[:MAX_JOBS_SHOWN],
        "storage": None,
    }


def _empty(name: str) -> dict[str, Any]:
    return {
        "job": name,
        "label": name,
        "spent": 0.0,
        "direct": 0.0,
        "saved": {"cache": 0.0, "peer": 0.0},
        "served_bytes": {},
        "backend_requests": {},
        "backend_bytes": {},
    }


def _money(value: float, currency: str) -> str:
    return f"{value:.4f} {currency}"


def print_table(view: dict[str, Any], out: TextIO) -> None:
    """The ledger for a person: one line per job, then the totals."""
    currency = view.get("currency", "USD")
    since = view.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "the start"
    print(f"cost since {when} ({currency}; saved = without chunkd - spent, roughly)", file=out)
    header = f"{'job':<28} {'spent':>14} {'without':>14} {'saved cache':>14} {'saved peer':>14}"
    print(header + f" {'backend':>10} {'cache':>10} {'peer':>10}", file=out)
    rows = [*view.get("jobs", []), {"job": "total", **view.get("totals", {})}]
    for row in rows:
        served = row.get("served_bytes", {})
        saved = row.get("saved", {})
        print(
            f"{row['job'][:28]:<28} {_money(row.get('spent', 0.0), currency):>14} "
            f"{_money(row.get('direct', 0.0), currency):>14} "
            f"{_money(saved.get('cache', 0.0), currency):>14} "
            f"{_money(saved.get('peer', 0.0), currency):>14} "
            f"{human_size(served.get('backend', 0)):>10} "
            f"{human_size(served.get('ram', 0) + served.get('disk', 0)):>10} "
            f"{human_size(served.get('peer', 0)):>10}",
            file=out,
        )
    storage = view.get("storage")
    if storage:
        print(f"storage ({currency} a month; GB = 2^30 bytes):", file=out)
        for row in storage.get("checkpoints", []):
            print(
                f"  {row['name'][:40]:<40} {row['checkpoints']:>5} checkpoints "
                f"{human_size(row['stored_bytes']):>10} {_money(row['per_month'], currency):>14}",
                file=out,
            )
        if storage.get("truncated"):
            print(f"  (truncated: read {storage['read_at_most']} checkpoints at most)", file=out)
        _print_snapshots(storage.get("snapshots"), currency, out)
        _print_gc(storage.get("gc_reclaimable"), currency, out)
        print(
            f"  {'kept in all':<40} {'':>17} {human_size(storage.get('stored_bytes', 0)):>10} "
            f"{_money(storage.get('per_month', 0.0), currency):>14}",
            file=out,
        )


def _print_snapshots(snapshots: dict[str, Any] | None, currency: str, out: TextIO) -> None:
    """One line per frozen snapshot (its chunks once; its own apart), then them all."""
    if not snapshots:
        return
    for row in snapshots.get("snapshots", []):
        line = (
            f"  frozen {row['id'][:12]:<33} {human_size(row['own_bytes']):>13} own "
            f"{human_size(row['stored_bytes']):>10} {_money(row['per_month'], currency):>14}"
        )
        if row.get("error"):
            line += f"  ({row['error'][:200]})"
        elif not row.get("complete"):
            line += "  (read in part)"
        print(line, file=out)
    print(
        f"  {'frozen snapshots, each chunk once':<40} {'':>17} "
        f"{human_size(snapshots['stored_bytes']):>10} "
        f"{_money(snapshots['per_month'], currency):>14}",
        file=out,
    )
    if snapshots.get("truncated"):
        most = snapshots["read_at_most"]
        print(
            f"  (truncated: read {most['snapshots']} snapshots and {most['chunks']} chunks "
            "at most)",
            file=out,
        )


def _print_gc(gc: dict[str, Any] | None, currency: str, out: TextIO) -> None:
    """What the latest gc of each backend found to delete, and when."""
    if not gc:
        print("  gc would reclaim: unknown (no chunkd gc ran on this node)", file=out)
        return
    for row in gc.get("backends", []):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["at"]))
        what = "would reclaim" if row["dry_run"] else "reclaimed"
        print(
            f"  gc {row['backend'][:20]} {what} {human_size(row['bytes'])} "
            f"({row['chunks']} chunks; {'dry run' if row['dry_run'] else 'run'} at {when})",
            file=out,
        )


def cost(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run ``chunkd cost``; returns the exit status."""
    try:
        context = cacert_context(args.cacert)
    except OSError as exc:
        print(f"chunkd cost: cannot use --cacert {args.cacert} ({exc})", file=sys.stderr)
        return 2
    try:
        if args.since is not None:
            parse_since(args.since, time.time())  # said wrong before anything is asked
        if args.prometheus:
            view = prometheus_view(args.prometheus, args.since, args.job, context)
        else:
            query = {k: v for k, v in (("job", args.job), ("since", args.since)) if v}
            path = "/v1/cost/storage" if args.storage else "/v1/cost"
            url = f"{args.url.rstrip('/')}{path}?{urllib.parse.urlencode(query)}"
            view = _get_json(url, context)
    except InvalidRequestError as exc:
        print(f"chunkd cost: --since: {exc}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        print(f"chunkd cost: {unreachable(args.prometheus or args.url, exc)}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(view, out, indent=2)
        out.write("\n")
        return 0
    print_table(view, out)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``chunkd cost``."""
    parser = sub.add_parser(
        "cost",
        help="what data movement cost, by job: spent, without chunkd, saved",
        description="Print this node's cost ledger (GET /v1/cost), or with --prometheus "
        "the cluster's figures from Prometheus. Money is in the price tables' currency.",
    )
    http_options(parser)
    parser.add_argument("--job", help="only this job (its train_job name; none: no job)")
    parser.add_argument(
        "--since",
        metavar="T",
        help="only what happened since T: 1h, 30m, 2d ago, or an ISO time",
    )
    parser.add_argument("--json", action="store_true", help="print the JSON as it is")
    parser.add_argument(
        "--storage",
        action="store_true",
        help="what checkpoints and frozen snapshots keep in their backends (GET /v1/cost/storage)",
    )
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="ask this Prometheus (its HTTP API, /api/v1/query) for the cluster's figures",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd cost``; returns the exit status."""
    return cost(args)
