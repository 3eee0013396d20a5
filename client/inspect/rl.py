"""RL data: rollouts grouped by prompt, episodes step by step (``docs/inspector.md``).

The kind is detected from field names (:func:`detect`), with ``map`` overrides
(``prompt:question,completion:answer,reward:score``):

- **rollouts**: ``prompt``, ``completion`` (or ``response``) and ``reward``; optional
  ``advantage``, ``logprobs`` and ``group`` (or ``prompt_id``, ``uid``). A page groups
  its rows by ``group`` (by the prompt without one) and sorts each group by reward,
  highest first.
- **episodes**: ``episode`` (or ``episode_id``), ``reward`` and ``observation`` (or
  ``obs``) or ``action``, one row per step, with ``step`` and ``done`` (or
  ``terminated`` / ``truncated``); or a record per episode with a ``steps`` list of
  such steps.

A page is rows ``start`` to ``start + count``; the group or episode its last row
belongs to is completed from the rows after it (up to :data:`MAX_COMPLETION` of them,
and while the answer stays under twice the page's byte bound; a row whose group is null
starts none), so no group is shown cut, and ``next`` is the first row after it. Rows of one group
are expected next to each other (as rollouts are written); a group scattered over a
file shows as a group per page it appears in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

from chunkd.client.inspect.values import PAGE_BYTES, json_bytes
from chunkd.errors import InvalidRequestError

__all__ = ["ALIASES", "MAX_COMPLETION", "detect", "page", "parse_map"]

#: a group or an episode is completed from at most this many rows after the page
MAX_COMPLETION: Final = 10_000

#: each role's field names, first match wins (``map`` puts its own first)
ALIASES: Final[dict[str, tuple[str, ...]]] = {
    "prompt": ("prompt",),
    "completion": ("completion", "response"),
    "reward": ("reward",),
    "advantage": ("advantage",),
    "logprobs": ("logprobs",),
    "group": ("group", "prompt_id", "uid"),
    "episode": ("episode", "episode_id"),
    "step": ("step",),
    "observation": ("observation", "obs"),
    "action": ("action",),
    "done": ("done", "terminated", "truncated"),
    "steps": ("steps",),
}
_DONE_FIELDS: Final = ("done", "terminated", "truncated")


def parse_map(text: str | None) -> dict[str, str]:
    """``role:field,role:field`` as ``{role: field}``.

    Raises:
        InvalidRequestError: a role that is not one of :data:`ALIASES`, or a pair
            without its ``:``.
    """
    found: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        role, colon, field = (part.strip() for part in pair.partition(":"))
        if not colon or not field or role not in ALIASES:
            raise InvalidRequestError(
                f"map: {pair!r} is not ROLE:FIELD with ROLE one of {', '.join(ALIASES)} "
                "(e.g. map=prompt:question,completion:answer,reward:score)"
            )
        found[role] = field
    return found


def roles(fields: list[str], overrides: Mapping[str, str]) -> dict[str, str]:
    """Each role's field among ``fields``."""
    present = set(fields)
    found: dict[str, str] = {}
    for role, names in ALIASES.items():
        wanted = overrides.get(role)
        if wanted is not None:
            if wanted in present:
                found[role] = wanted
            continue
        name = next((n for n in names if n in present), None)
        if name is not None:
            found[role] = name
    return found


def detect(fields: list[str] | None, overrides: Mapping[str, str] | None = None) -> str | None:
    """``"rollouts"``, ``"episodes"`` or None: the kind of RL data ``fields`` hold."""
    if not fields:
        return None
    found = roles(fields, overrides or {})
    if {"prompt", "completion", "reward"} <= found.keys():
        return "rollouts"
    if "steps" in found:
        return "episodes"
    if {"episode", "reward"} <= found.keys() and ("observation" in found or "action" in found):
        return "episodes"
    return None


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=False)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, int | float) and value != 0)


def page(
    kind: str,
    rows: Iterator[tuple[int, Any]],
    fields: list[str],
    overrides: Mapping[str, str],
    start: int,
    count: int,
) -> dict[str, Any]:
    """The ``rl`` answer of ``kind`` from rows ``start``, ``start + 1``, ... (``rows``
    yields them as ``(index, value)``, values encoded)."""
    found = roles(fields, overrides)
    per_episode = kind == "episodes" and "steps" in found
    if kind == "rollouts":
        group = found.get("group") or found["prompt"]
    elif per_episode:
        group = None
    else:
        group = found["episode"]
    taken: list[tuple[int, dict[str, Any]]] = []
    used = 0
    next_row: int | None = None
    page_end: int | None = None  # the last row of the page proper, once it is full
    for index, value in rows:
        record = value if isinstance(value, dict) else {}
        if page_end is None and len(taken) < count and (used < PAGE_BYTES or not taken):
            taken.append((index, record))
            used += json_bytes(record)
            continue
        if page_end is None:
            page_end = taken[-1][0]
        # Past the page: complete its last group (an episode record is whole already),
        # with at most MAX_COMPLETION more rows and within the page's byte bound; a row
        # with no group (a null) starts none.
        held = taken[-1][1].get(group) if group is not None else None
        last = _key(held)
        if (
            held is not None
            and index - page_end <= MAX_COMPLETION
            and used < 2 * PAGE_BYTES
            and _key(record.get(group)) == last
        ):
            taken.append((index, record))
            used += json_bytes(record)
            continue
        next_row = index
        break
    answer: dict[str, Any] = {"kind": kind, "start": start, "next": next_row, "roles": found}
    if kind == "rollouts":
        answer["groups"] = _groups(taken, found, group or found["prompt"])
    elif per_episode:
        answer["episodes"] = [_episode_record(i, r, found, overrides) for i, r in taken]
    else:
        answer["episodes"] = _episodes(taken, found, group or found["episode"])
    return answer


def _groups(
    taken: list[tuple[int, dict[str, Any]]], found: dict[str, str], group: str
) -> list[dict[str, Any]]:
    known = {
        found[r]
        for r in ("prompt", "completion", "reward", "advantage", "logprobs", "group")
        if r in found
    }
    groups: dict[str, dict[str, Any]] = {}
    for index, record in taken:
        entry = groups.setdefault(
            _key(record.get(group)),
            {
                "prompt": record.get(found["prompt"]),
                "group": record.get(found["group"]) if "group" in found else None,
                "rollouts": [],
            },
        )
        entry["rollouts"].append(
            {
                "index": index,
                "completion": record.get(found["completion"]),
                "reward": record.get(found["reward"]),
                "advantage": record.get(found["advantage"]) if "advantage" in found else None,
                "logprobs": record.get(found["logprobs"]) if "logprobs" in found else None,
                "fields": {k: v for k, v in record.items() if k not in known},
            }
        )
    for entry in groups.values():
        # highest reward first; a missing or non-numeric reward last; ties in row order
        entry["rollouts"].sort(
            key=lambda r: (_number(r["reward"]) is None, -(_number(r["reward"]) or 0.0), r["index"])
        )
    return list(groups.values())


def _step(index: int, record: Mapping[str, Any], found: dict[str, str]) -> dict[str, Any]:
    known = {found[r] for r in ("episode", "step", "observation", "action", "reward") if r in found}
    known |= {f for f in _DONE_FIELDS if f in record}
    done_fields = [f for f in (found.get("done"), *_DONE_FIELDS) if f and f in record]
    return {
        "index": index,
        "step": record.get(found["step"]) if "step" in found else None,
        "observation": record.get(found["observation"]) if "observation" in found else None,
        "action": record.get(found["action"]) if "action" in found else None,
        "reward": record.get(found["reward"]) if "reward" in found else None,
        "done": any(_truthy(record.get(f)) for f in done_fields) if done_fields else None,
        "fields": {k: v for k, v in record.items() if k not in known},
    }


def _summary(episode: Any, steps: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [_number(s["reward"]) for s in steps]
    return {
        "episode": episode,
        "return": sum(r for r in rewards if r is not None),
        "length": len(steps),
        "steps": steps,
    }


def _episodes(
    taken: list[tuple[int, dict[str, Any]]], found: dict[str, str], episode: str
) -> list[dict[str, Any]]:
    runs: dict[str, tuple[Any, list[dict[str, Any]]]] = {}
    for index, record in taken:
        value = record.get(episode)
        runs.setdefault(_key(value), (value, []))[1].append(_step(index, record, found))
    return [_summary(value, steps) for value, steps in runs.values()]


def _episode_record(
    index: int, record: dict[str, Any], found: dict[str, str], overrides: Mapping[str, str]
) -> dict[str, Any]:
    raw = record.get(found["steps"])
    steps = raw if isinstance(raw, list) else []
    inner_fields: list[str] = []
    for s in steps[:8]:
        if isinstance(s, dict):
            inner_fields += [k for k in s if k not in inner_fields]
    inner = roles(inner_fields, overrides)
    episode = record.get(found["episode"]) if "episode" in found else index
    summary = _summary(
        episode, [_step(i, s if isinstance(s, dict) else {}, inner) for i, s in enumerate(steps)]
    )
    summary["index"] = index
    summary["fields"] = {
        k: v for k, v in record.items() if k not in (found["steps"], found.get("episode"))
    }
    return summary
