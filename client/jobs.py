"""Which job a trainer's work is accounted to: :func:`job_name`.

A **job** is a name the client claims (``train_job``): the daemon labels the trainers'
waits (``chunkd_loader_*``) and the cost of their reads (``chunkd_cost_*``) with it.
It is for accounting, not security: any process may claim any name, and the daemon
records the caller's uid beside it.

The name is the first of these that is set, in this order:

1. the ``train_job=`` argument (``Client(train_job=...)``, the loaders', the stall
   meter's);
2. ``$CHUNKD_JOB``;
3. ``$SLURM_JOB_ID`` (Slurm);
4. ``$TORCHELASTIC_RUN_ID`` (``torchrun``; its default ``none`` is no name);
5. a Kubernetes pod's job label, read from the downward API's labels file
   (``$CHUNKD_POD_LABELS``, default :data:`POD_LABELS`): the labels
   :data:`POD_JOB_LABELS`, in that order.

A name is :data:`~chunkd.client.protocol.JOB_NAME` (1 to 128 characters: a letter or
digit first, then letters, digits and ``._:@/+-``), and neither ``other`` nor ``none``.
A bad argument raises :class:`ValueError`; a bad value from the environment or the
labels file is skipped (a warning is logged once per value) and the next source is
tried. The labels file is read up to :data:`MAX_LABELS_BYTES`.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from contextvars import ContextVar
from pathlib import Path
from typing import Final

from chunkd.client.protocol import check_job_name
from chunkd.errors import InvalidRequestError

__all__ = [
    "FOR_DATASET",
    "JOB_ENV",
    "MAX_LABELS_BYTES",
    "POD_JOB_LABELS",
    "POD_LABELS",
    "POD_LABELS_ENV",
    "job_name",
]

log = logging.getLogger("chunkd.client")

#: the environment variables that name a job, in the order they are tried (after the
#: argument)
JOB_ENV: Final = ("CHUNKD_JOB", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
#: where the Kubernetes downward API's labels file is, unless ``$CHUNKD_POD_LABELS`` says
POD_LABELS: Final = Path("/etc/podinfo/labels")
#: the variable naming another labels file
POD_LABELS_ENV: Final = "CHUNKD_POD_LABELS"
#: the pod labels that name its job, in the order they are tried: a Kubernetes Job's
#: pods carry the first two, a Kubeflow training job's the third
POD_JOB_LABELS: Final = (
    "batch.kubernetes.io/job-name",
    "job-name",
    "training.kubeflow.org/job-name",
)
#: the most bytes of the labels file read (the rest is not looked at)
MAX_LABELS_BYTES: Final = 64 * 1024

#: the dataset (its name) the reads made now are for: a dataset's source sets it around
#: its reads, and the client sends it as the ``dataset`` of its ``read``, ``readv`` and
#: ``prefetch`` requests, so the daemon accounts their cost to that name
FOR_DATASET: ContextVar[str | None] = ContextVar("chunkd_for_dataset", default=None)

#: values already warned of (once each), bounded
_WARNED: set[str] = set()
#: a backslash escape in a quoted label value (a label's value has none; Go quotes it)
_ESCAPE: Final = re.compile(r"\\(.)", re.DOTALL)


def job_name(train_job: str | None = None) -> str | None:
    """The job this process's work is accounted to (see the module docstring).

    Args:
        train_job: the job's name; None: from the environment, else the pod's labels.

    Returns:
        The name, or None where no source names one.

    Raises:
        ValueError: ``train_job`` is given and is no job name.
    """
    if train_job is not None:
        try:
            return check_job_name(train_job)
        except InvalidRequestError as exc:
            raise ValueError(str(exc)) from None
    for variable in JOB_ENV:
        value = os.environ.get(variable)
        if not value:
            continue
        if variable == "TORCHELASTIC_RUN_ID" and value == "none":
            continue  # torchrun's default run id when none was given: no job
        checked = _checked(value, f"${variable}")
        if checked is not None:
            return checked
    path = Path(os.environ.get(POD_LABELS_ENV) or POD_LABELS)
    for label, value in _pod_labels(path):
        checked = _checked(value, f"the pod label {label} in {path}")
        if checked is not None:
            return checked
    return None


def _checked(value: str, where: str) -> str | None:
    try:
        return check_job_name(value)
    except InvalidRequestError as exc:
        key = f"{where}={value[:140]}"
        if key not in _WARNED and len(_WARNED) < 64:
            _WARNED.add(key)
            log.warning("chunkd: %s does not name a job, skipped: %s", where, exc)
        return None


def _pod_labels(path: Path) -> list[tuple[str, str]]:
    """The job labels of a downward API labels file (lines ``key="value"``), in the
    order of :data:`POD_JOB_LABELS`; none where the file cannot be read."""
    try:
        # O_NONBLOCK: a FIFO or a device named there must not hang the client
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        with os.fdopen(fd, "rb", closefd=False) as labels:
            data = labels.read(MAX_LABELS_BYTES)
    except OSError:
        return []
    finally:
        os.close(fd)
    if len(data) == MAX_LABELS_BYTES:  # cut: the last line may be half of one
        data = data[: data.rfind(b"\n") + 1]
    found: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or key not in POD_JOB_LABELS or key in found:
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            # one pass, so that an escaped backslash before a quote stays a backslash
            value = _ESCAPE.sub(lambda m: m.group(1), value[1:-1])
        found[key] = value
    return [(label, found[label]) for label in POD_JOB_LABELS if label in found]
