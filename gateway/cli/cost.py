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
from typing import Any, Final, TextIO

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


#: what the figures cover without ``--since``: said in the table's header and the JSON
LIVE_SERIES: Final = (
    "the live series as they stand: each daemon's counters since it started; jobs "
    "that ended and what came before a daemon's restart are not in them"
)
#: the money figures a row is ranked by (spent + without chunkd)
_DOLLARS: Final = '{__name__=~"chunkd_cost_(direct_)?dollars_total"%s}'
#: each figure: its metric and the label its parts are by ("" for one number)
_FIGURES: Final = {
    "spent": ("chunkd_cost_dollars_total", ""),
    "direct": ("chunkd_cost_direct_dollars_total", ""),
    "saved": ("chunkd_cost_saved_dollars_total", "source"),
    "served_bytes": ("chunkd_cost_served_bytes_total", "source"),
    "backend_requests": ("chunkd_cost_backend_requests_total", "op"),
    "backend_bytes": ("chunkd_cost_backend_bytes_total", "direction"),
    "written_bytes": ("chunkd_cost_written_bytes_total", "kind"),
    "direct_requests": ("chunkd_cost_direct_requests_total", "op"),
    "direct_bytes": ("chunkd_cost_direct_bytes_total", ""),
}
#: the figures that are one number, not parts by a label
_SCALARS: Final = ("spent", "direct", "direct_bytes")
#: the currency said when neither --currency nor the local daemon says one
ASSUMED_CURRENCY: Final = "USD"


def promql_string(text: str) -> str:
    """``text`` as a PromQL double-quoted string (backslashes and quotes escaped)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _queries(window: str | None, job: str | None) -> dict[str, tuple[str, str]]:
    """The PromQL of each figure, raw metric expressions (no recording rule needed):
    (the totals', the rows'). The totals are ``sum`` over every series; the rows are
    those of the :data:`MAX_JOBS_SHOWN` jobs that spent most (spent + without chunkd,
    ``topk``), so that Prometheus cuts, not the CLI. ``job``: only that job's series."""
    only = "" if job is None else f",train_job={promql_string(job)}"
    matcher = "{" + only.lstrip(",") + "}" if only else ""

    def series(selector: str) -> str:
        return f"increase({selector}[{window}])" if window else selector

    top = f"topk({MAX_JOBS_SHOWN}, sum by (train_job) ({series(_DOLLARS % only)}))"
    queries = {}
    for figure, (metric, part) in _FIGURES.items():
        selected = series(metric + matcher)
        by = f"sum by ({part}) " if part else "sum "
        rows = f"sum by (train_job{', ' + part if part else ''}) ({selected})"
        queries[figure] = (f"{by}({selected})", f"{rows} and on (train_job) {top}")
    return queries


def _ask(base: str, query: str, context: Any) -> list[dict[str, Any]]:
    url = f"{base.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    answer = _get_json(url, context)
    if answer.get("status") != "success":
        raise ValueError(f"Prometheus answered {answer.get('error', answer)!r} to {query}")
    return list(answer["data"]["result"])


def prometheus_view(
    base: str,
    since: str | None,
    job: str | None,
    context: Any,
    currency: str | None = None,
) -> dict[str, Any]:
    """The cluster's figures from the Prometheus at ``base``, shaped as ``GET /v1/cost``
    answers (jobs by ``train_job`` label; money in the tables' currency, which
    Prometheus does not know: ``currency``, else :data:`ASSUMED_CURRENCY` with
    ``"currency_assumed": true``): the totals
    over every series (of ``job`` only, when given), the rows of the
    :data:`MAX_JOBS_SHOWN` jobs that spent most. Without ``since``, what the counters
    say now (:data:`LIVE_SERIES`); with it, their increase since then."""
    jobs: dict[str, dict[str, Any]] = {}
    totals = _empty("")
    window = _window(since)
    for figure, (total_query, rows_query) in _queries(window, job).items():
        part = _FIGURES[figure][1]
        for sample in _ask(base, total_query, context):
            _count(totals, figure, sample["metric"].get(part), float(sample["value"][1]))
        for sample in _ask(base, rows_query, context):
            labels = sample["metric"]
            name = labels.get("train_job", "none")
            row = jobs.setdefault(name, _empty(name))
            _count(row, figure, labels.get(part), float(sample["value"][1]))
    rows = sorted(jobs.values(), key=lambda r: (-r["spent"] - r["direct"], r["job"]))
    del totals["job"], totals["label"]
    now = time.time()
    return {
        "since": None if since is None else parse_since(since, now),
        "now": now,
        "covers": LIVE_SERIES if window is None else f"their increase over the last {window}",
        "currency": currency or ASSUMED_CURRENCY,
        "currency_assumed": currency is None,
        "source": "prometheus",
        "totals": totals,
        "jobs": rows[:MAX_JOBS_SHOWN],
        "storage": None,
    }


def _count(row: dict[str, Any], figure: str, part: str | None, value: float) -> None:
    if figure in _SCALARS:
        row[figure] += int(value) if figure == "direct_bytes" else value
    elif part is not None:
        # counts and bytes are whole numbers, as GET /v1/cost says them
        add: float = value if figure == "saved" else int(value)
        row[figure][part] = row[figure].get(part, 0) + add


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
        "written_bytes": {},
        "direct_requests": {},
        "direct_bytes": 0,
    }


def _money(value: float, currency: str) -> str:
    return f"{value:.4f} {currency}"


def print_table(view: dict[str, Any], out: TextIO) -> None:
    """The ledger for a person: one line per job, then the totals."""
    currency = view.get("currency", ASSUMED_CURRENCY)
    # Prometheus does not know the tables' currency: say when it is a guess
    unit = f"{currency} assumed, give --currency" if view.get("currency_assumed") else currency
    since = view.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "the start"
    if view.get("source") == "prometheus" and since is None:
        # Prometheus's counters: what they cover says it, not a time
        print(f"cost of the cluster: {view.get('covers', LIVE_SERIES)}", file=out)
        print(f"({unit}; saved = without chunkd - spent, roughly)", file=out)
    else:
        print(f"cost since {when} ({unit}; saved = without chunkd - spent, roughly)", file=out)
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
    if args.prometheus and args.storage:
        print(
            "chunkd cost: --storage is one node's catalog (GET /v1/cost/storage), not the "
            "cluster's: ask it without --prometheus",
            file=sys.stderr,
        )
        return 2
    base = args.url.rstrip("/")
    try:
        if args.since is not None:
            parse_since(args.since, time.time())  # said wrong before anything is asked
        if args.prometheus:
            currency = args.currency or _local_currency(base, context)
            view = prometheus_view(args.prometheus, args.since, args.job, context, currency)
        else:
            query = {k: v for k, v in (("job", args.job), ("since", args.since)) if v}
            view = _get_json(f"{base}/v1/cost?{urllib.parse.urlencode(query)}", context)
            if args.storage:
                view["storage"] = _get_json(f"{base}/v1/cost/storage", context)
    except InvalidRequestError as exc:
        print(f"chunkd cost: --since: {exc}", file=sys.stderr)
        return 2
    except urllib.error.HTTPError as exc:
        print(f"chunkd cost: {_refusal(exc)}", file=sys.stderr)
        # the daemon's 400: a bad --job (or --since) it was asked for
        return 2 if exc.code == 400 and _from_daemon(exc) else 1
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        print(f"chunkd cost: {unreachable(args.prometheus or args.url, exc)}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(view, out, indent=2)
        out.write("\n")
        return 0
    print_table(view, out)
    return 0


def _local_currency(base: str, context: Any) -> str | None:
    """The price tables' currency as the local daemon says it (``GET /v1/cost`` of the
    ``none`` row: a small answer), None where it cannot be asked."""
    try:
        view = _get_json(f"{base}/v1/cost?job=none", context)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    currency = view.get("currency") if isinstance(view, dict) else None
    return currency if isinstance(currency, str) and currency else None


def _refusal(exc: urllib.error.HTTPError) -> str:
    """What an HTTP error answer of the daemon or Prometheus means: its own message (the
    daemon's JSON ``message``), and for a 401 or 403 what to do."""
    try:
        body = json.loads(exc.read(64 * 1024))
        message = body.get("message") or body.get("error") or exc.reason
    except (ValueError, OSError, AttributeError):
        message = exc.reason
    text = f"{exc.url} answered HTTP {exc.code}: {' '.join(str(message).split())[:500]}"
    if exc.code in (401, 403) and _from_daemon(exc):
        text += (
            " (the daemon answers its cost routes to clients on its own host, or to those "
            "that send server.token, which chunkd cost does not: run it on the node, or "
            "through an ssh tunnel: ssh -L 8470:127.0.0.1:8470 NODE)"
        )
    return text


def _from_daemon(exc: urllib.error.HTTPError) -> bool:
    """Whether the error answer is the daemon's (its cost routes), not Prometheus's."""
    return "/v1/cost" in str(exc.url)


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
        help="also what checkpoints and frozen snapshots keep in their backends "
        "(GET /v1/cost/storage); not with --prometheus",
    )
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="ask this Prometheus (its HTTP API, /api/v1/query) for the cluster's figures",
    )
    parser.add_argument(
        "--currency",
        metavar="CODE",
        help="with --prometheus: the price tables' currency (default: the local daemon's, "
        f"else {ASSUMED_CURRENCY} assumed)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``chunkd cost``; returns the exit status."""
    return cost(args)
