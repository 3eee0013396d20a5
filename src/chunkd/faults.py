"""Named fault points: where the daemon's critical sequences can be made to fail.

Each step of a sequence that must survive a crash or an I/O error (a chunk's way into
the cache, the index's commits, a checkpoint's commit protocol, a peer transfer,
eviction) calls :func:`point` with its name. :data:`POINTS` lists every name once, with
the moment it marks; the fault walk (``tests/test_fault_points.py``) runs every entry
with every :data:`ACTIONS` entry, so a new point is walked as soon as it is listed.

A point does nothing unless faults are armed, and they are armed only by both of:

* ``CHUNKD_FAULTS``: a comma-separated list of ``POINT:ACTION[@PROBABILITY][#NTH]``,
  e.g. ``ckpt.part:crash,disk.rename:eio@0.1``. ``ACTION`` is ``crash`` (the
  process kills itself with SIGKILL, as the kernel's OOM killer or a power cut would
  end it), ``eio`` or ``enospc`` (the step raises that :class:`OSError`). ``@P`` fires
  with probability P (seeded by ``CHUNKD_FAULTS_SEED``, logged, so a run replays);
  ``#N`` fires from the Nth time the point is reached on (1 by default);
* an explicit switch: ``chunkd serve --enable-faults``. Without it a set
  ``CHUNKD_FAULTS`` is ignored with a warning: a stray variable never makes a
  production daemon fail on purpose.

An armed daemon says so in its log at start (``FAULT INJECTION IS ON``) and in
``/v1/stats`` (``faults``). Disarmed, :func:`point` is one dictionary truth test:
``bench --only faults`` measures it against the hot path it sits on.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from chunkd.errors import ConfigError

__all__ = [
    "ACTIONS",
    "POINTS",
    "Fault",
    "arm",
    "arm_from_environment",
    "armed",
    "disarm",
    "hits",
    "parse",
    "point",
]

log = logging.getLogger("chunkd.faults")

#: every fault point, with the moment it marks (the walk runs each with each action)
POINTS: Final[Mapping[str, str]] = {
    "cache.insert": "a fetched chunk is hashed, before the cache's tiers take it",
    "disk.write": "the disk tier's temporary file is written, before its fsync",
    "disk.rename": "the temporary file is complete, before it is renamed to its id",
    "disk.read": "a chunk file is about to be read back from the disk tier",
    "disk.evict": "an evicted chunk's record is deleted, before its file is unlinked",
    "index.commit": "a batch of index records is about to be committed to lmdb",
    "ckpt.stage": "a rank's staged memfd has arrived, before the daemon takes the job",
    "ckpt.sync": "a save's chunks are written, before the syncfs that makes them durable",
    "ckpt.journal": "a save's chunks are durable, before its journal (level local) is written",
    "ckpt.intent": "the save is local, before its intent goes to the backend",
    "ckpt.upload": "a save's chunk is about to be uploaded to the backend",
    "ckpt.part": "every chunk of a rank's part is uploaded, before the part is written",
    "ckpt.manifest": "every part is in, before the manifest (the commit) is written",
    "ckpt.cleanup": "the manifest is written, before the save's journal is removed",
    "peer.send": "a node is about to send a chunk to a peer that asked for it",
    "peer.receive": "a chunk's bytes came from a peer, before they are verified",
}

#: what an armed point can do
ACTIONS: Final = ("crash", "eio", "enospc")

_ERRNO: Final = {"eio": errno.EIO, "enospc": errno.ENOSPC}
_SPEC: Final = re.compile(
    r"(?P<point>[a-z_.]+):(?P<action>[a-z]+)(?:@(?P<p>[0-9.]+))?(?:#(?P<nth>[0-9]+))?"
)


@dataclass(frozen=True, slots=True)
class Fault:
    """What one armed point does: ``action``, with ``probability``, from the ``nth`` hit."""

    point: str
    action: str
    probability: float = 1.0
    nth: int = 1

    def __str__(self) -> str:
        text = f"{self.point}:{self.action}"
        if self.probability < 1:
            text += f"@{self.probability:g}"
        return text + (f"#{self.nth}" if self.nth > 1 else "")


_armed: dict[str, Fault] = {}
_hits: dict[str, int] = {}
_lock = threading.Lock()
_random = random.Random()


def parse(spec: str) -> list[Fault]:
    """The faults ``spec`` names (see the module docstring).

    Raises:
        ConfigError: an entry that is malformed or names an unknown point or
            action, with the list of what is known.
    """
    faults = []
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        match = _SPEC.fullmatch(entry)
        if match is None:
            raise ConfigError(
                f"CHUNKD_FAULTS entry {entry!r} is not POINT:ACTION[@PROBABILITY][#NTH]"
            )
        name, action = match["point"], match["action"]
        if name not in POINTS:
            raise ConfigError(
                f"CHUNKD_FAULTS names an unknown fault point {name!r}; known: {', '.join(POINTS)}"
            )
        if action not in ACTIONS:
            raise ConfigError(
                f"CHUNKD_FAULTS entry {entry!r}: unknown action {action!r}; "
                f"known: {', '.join(ACTIONS)}"
            )
        probability = float(match["p"] or 1)
        nth = int(match["nth"] or 1)
        if not 0 < probability <= 1 or nth < 1:
            raise ConfigError(
                f"CHUNKD_FAULTS entry {entry!r}: a probability is in (0, 1], #N is 1 or more"
            )
        faults.append(Fault(name, action, probability, nth))
    return faults


def arm(faults: list[Fault], *, seed: int | None = None) -> None:
    """Arm ``faults`` (replacing what was armed); ``seed`` fixes probabilistic ones."""
    with _lock:
        _armed.clear()
        _hits.clear()
        _armed.update((fault.point, fault) for fault in faults)
        _random.seed(seed)


def disarm() -> None:
    """Disarm every point."""
    arm([])


def arm_from_environment(enabled: bool, environ: Mapping[str, str] = os.environ) -> list[Fault]:
    """Arm what ``CHUNKD_FAULTS`` names if ``enabled``; returns what was armed.

    Logs loudly when it arms anything, and warns when the variable is set but the
    switch is not.

    Raises:
        ConfigError: ``CHUNKD_FAULTS`` is malformed (checked even when not
            enabled, so a typo shows before the run that needed it).
    """
    spec = environ.get("CHUNKD_FAULTS", "")
    faults = parse(spec)
    if not faults:
        return []
    if not enabled:
        log.warning(
            "CHUNKD_FAULTS is set (%s) but ignored: fault injection needs "
            "`chunkd serve --enable-faults`",
            spec,
        )
        return []
    raw_seed = environ.get("CHUNKD_FAULTS_SEED")
    seed = int(raw_seed) if raw_seed else random.SystemRandom().randrange(1 << 32)
    arm(faults, seed=seed)
    log.warning(
        "FAULT INJECTION IS ON: %s (CHUNKD_FAULTS_SEED=%d). This daemon will fail on "
        "purpose; never run it with data you need",
        ", ".join(map(str, faults)),
        seed,
    )
    return faults


def armed() -> list[str]:
    """The armed faults, as ``CHUNKD_FAULTS`` entries."""
    return [str(fault) for fault in _armed.values()]


def hits() -> dict[str, int]:
    """How many times each armed point was reached."""
    with _lock:
        return dict(_hits)


def point(name: str, error: Callable[[int, str], BaseException] = OSError) -> None:
    """Mark fault point ``name``; an armed one crashes the process or raises.

    ``error`` builds what an ``eio`` or ``enospc`` raises from (errno, message): an
    :class:`OSError` by default, or the error the step's own I/O would raise.
    """
    if not _armed:
        return
    _fire(name, error)


def _fire(name: str, error: Callable[[int, str], BaseException]) -> None:
    assert name in POINTS, f"fault point {name!r} is not in faults.POINTS"
    fault = _armed.get(name)
    if fault is None:
        return
    with _lock:
        count = _hits[name] = _hits.get(name, 0) + 1
        if count < fault.nth or _random.random() >= fault.probability:
            return
    if fault.action == "crash":
        # Straight to stderr, unbuffered: the process is gone the next instant.
        os.write(2, f"chunkd: fault point {name}: crash (SIGKILL)\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)
    code = _ERRNO[fault.action]
    log.warning("fault point %s: injected %s", name, fault.action.upper())
    raise error(code, f"{os.strerror(code)} (injected at fault point {name})")
