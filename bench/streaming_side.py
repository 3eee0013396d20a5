"""MosaicML Streaming, run as a user runs it: the baseline of the time-to-first-batch bench.

``mosaicml-streaming`` 0.13 pins ``numpy<2.2`` and ``import streaming`` loads torchvision
and transformers, so it never goes into chunkd's venv. It gets a venv of its own
(:func:`ensure_venv`, built once from the package registries under ``.bench-venv/``), and
this file is two things:

- **in chunkd's venv**, a module: :func:`ensure_venv` and :class:`StreamingVenv`, which
  run the commands below in that venv's interpreter;
- **in that venv**, a script (``VENV/bin/python bench/streaming_side.py COMMAND``):

  - ``probe``: imports ``streaming`` and prints its version and import time;
  - ``convert``: reads the bench's Parquet files with pyarrow and writes the same rows
    with Streaming's own ``MDSWriter``, which uploads the shards to ``--remote`` itself;
  - ``read``: one rank of a job (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` set by
    the caller): a ``StreamingDataset`` over ``--remote`` with its cache in ``--local``,
    in a torch ``DataLoader`` with ``--workers`` workers, read to the end of the epoch. It
    prints one JSON line of timings and writes the ids and text CRCs it read.

The venv holds torch 2.13.0 (the CPU build on this disk), ``mosaicml-streaming`` 0.13.0
and every dependency it declares except torchvision: PyPI's torchvision does not import
beside this torch (``operator torchvision::nms does not exist``), and the pins of a
torchvision that would pull a CUDA torch of gigabytes. ``streaming/__init__`` imports
``streaming.vision``, whose CIFAR/ImageNet/COCO classes subclass torchvision's
``VisionDataset`` at import time; :func:`_stub_torchvision` gives it those two names and
nothing else. ``StreamingDataset`` and ``MDSWriter`` never call them: their download,
cache, partitioning, shuffling and decoding are Streaming's own code, unchanged.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STREAMING_VERSION", "StreamingVenv", "Unavailable", "default_venv", "ensure_venv"]

STREAMING_VERSION = "0.13.0"
#: exactly so: a CPU build lies on this disk; any other torch spec pulls gigabytes
TORCH_SPEC = "torch==2.13.0"
#: what the venv never gets (see the module docstring)
_LEFT_OUT = {"torchvision"}
#: what the bench's conversion needs beside Streaming's own dependencies
_EXTRA = ["pyarrow"]
_STAMP = ".ready"
_HERE = Path(__file__).resolve()


def default_venv() -> Path:
    """Where the venv lives: ``$BENCH_STREAMING_VENV`` or ``.bench-venv/streaming-0.13.0``
    at the repository root (git-ignored; it outlives ``bench/out/work``, which every run
    removes)."""
    override = os.environ.get("BENCH_STREAMING_VENV")
    if override:
        return Path(override)
    return _HERE.parent.parent / ".bench-venv" / f"streaming-{STREAMING_VERSION}"


@dataclass(frozen=True)
class Unavailable:
    """Why the Streaming baseline cannot run here; the bench reports it instead of failing."""

    reason: str


@dataclass(frozen=True)
class StreamingVenv:
    """A venv where ``import streaming`` works, and the commands of this script in it."""

    root: Path

    @property
    def python(self) -> Path:
        """The venv's interpreter."""
        return self.root / "bin" / "python"

    def args(self, command: str, *options: str) -> list[str]:
        """The command line of this script's ``command`` in the venv."""
        return [str(self.python), str(_HERE), command, *options]

    def run_json(self, command: str, *options: str, env: dict[str, str] | None = None) -> Any:
        """Run ``command`` to its end and return the JSON of its last line of output."""
        done = subprocess.run(
            self.args(command, *options),
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"streaming_side.py {command} failed ({done.returncode}):\n{done.stderr[-4000:]}"
            )
        return json.loads(done.stdout.strip().splitlines()[-1])


def ensure_venv(root: Path | None = None, *, build: bool = True) -> StreamingVenv | Unavailable:
    """The Streaming venv at ``root`` (:func:`default_venv`), built on first use.

    Idempotent: a venv whose stamp says it was built and probed is used as it is; several
    callers at once build it once (a file lock). Building takes a couple of minutes and
    about 2 GiB: torch from its wheel on this disk, then Streaming's dependencies from the
    registries pip is configured with. Without ``build`` a missing venv is
    :class:`Unavailable`. A failed install is :class:`Unavailable` too, with pip's last
    words and the log's path; the half-built venv is removed so that the next run tries
    again.
    """
    root = root or default_venv()
    venv = StreamingVenv(root)
    if (root / _STAMP).exists():
        return venv
    if not build:
        return Unavailable(
            f"no Streaming venv at {root} (build it with "
            f"`python bench/streaming_side.py setup`, or run the bench without --quick)"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f".{root.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / _STAMP).exists():  # another run built it while this one waited
            return venv
        log = root.parent / f"{root.name}.install.log"
        started = time.monotonic()
        print(f"ttfb: building the Streaming venv at {root} (once; log: {log})", flush=True)
        try:
            _build(root, log)
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            shutil.rmtree(root, ignore_errors=True)
            return Unavailable(f"the Streaming venv could not be built ({e}); see {log}")
        (root / _STAMP).write_text(
            json.dumps({"streaming": STREAMING_VERSION, "seconds": time.monotonic() - started})
        )
    return venv


def _build(root: Path, log: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    with log.open("w") as out:

        def step(*args: str) -> str:
            out.write(f"\n$ {' '.join(args)}\n")
            out.flush()
            done = subprocess.run(args, capture_output=True, text=True, timeout=1800, check=False)
            out.write(done.stdout + done.stderr)
            out.flush()
            if done.returncode != 0:
                tail = [line for line in done.stderr.splitlines() if "WARNING" not in line]
                raise RuntimeError(f"`{' '.join(args[:5])} ...` failed: {' '.join(tail[-3:])}")
            return done.stdout

        python = str(root / "bin" / "python")
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        step(sys.executable, "-m", "venv", str(root))
        step(*pip, TORCH_SPEC)
        step(*pip, "--no-deps", f"mosaicml-streaming=={STREAMING_VERSION}")
        wanted = step(python, str(_HERE), "requirements").split()
        constraints = root / "constraints.txt"
        constraints.write_text(TORCH_SPEC + "\n")
        step(*pip, "-c", str(constraints), *wanted, *_EXTRA)
        probe = json.loads(step(python, str(_HERE), "probe").strip().splitlines()[-1])
        out.write(f"\nprobe: {probe}\n")


# ---------------------------------------------------------------------------------------
# In the Streaming venv.


def _requirements() -> None:
    """Print the distribution's runtime requirements, less what the venv leaves out."""
    import re
    from importlib.metadata import requires

    for line in requires("mosaicml-streaming") or []:
        if "extra ==" in line:
            continue  # an extra (dev, docs, ...)
        spec = line.split(";")[0].strip()
        name = re.match(r"[A-Za-z0-9._-]+", spec)
        if name is None or name.group(0).lower() in _LEFT_OUT:
            continue
        print(spec.replace(" ", ""))


def _stub_torchvision() -> bool:
    """Give ``streaming.vision`` the two torchvision names it needs at import, where no
    torchvision is installed; True when it was stubbed."""
    import importlib.machinery
    import importlib.util
    import types

    if importlib.util.find_spec("torchvision") is not None:
        return False

    def unused(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("torchvision is not installed in the Streaming bench venv")

    class VisionDataset:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            unused(*args, **kwargs)

    modules: dict[str, Any] = {}
    for name in (
        "torchvision",
        "torchvision.datasets",
        "torchvision.transforms",
        "torchvision.transforms.functional",
    ):
        module = modules[name] = types.ModuleType(name)
        # A spec, so that importlib.util.find_spec answers; transformers then looks for
        # the distribution's metadata, finds none and takes torchvision as absent.
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    modules["torchvision.datasets"].VisionDataset = VisionDataset
    modules["torchvision.transforms.functional"].to_tensor = unused
    modules["torchvision"].datasets = modules["torchvision.datasets"]
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
    sys.modules.update(modules)
    return True


def _probe() -> None:
    started = time.perf_counter()
    stubbed = _stub_torchvision()
    import numpy
    import streaming
    import torch

    print(
        json.dumps(
            {
                "streaming": streaming.__version__,
                "torch": torch.__version__,
                "numpy": numpy.__version__,
                "torchvision": "stub" if stubbed else "installed",
                "import_s": time.perf_counter() - started,
            }
        )
    )


def _convert(options: argparse.Namespace) -> None:
    """The Parquet files' rows, in file order, through ``MDSWriter`` to ``--remote``."""
    started = time.perf_counter()
    _stub_torchvision()
    import pyarrow.parquet as pq
    from streaming import MDSWriter

    columns = {"id": "int64", "label": "int64", "text": "str"}
    samples = 0
    with MDSWriter(
        out=(options.local, options.remote),
        keep_local=True,  # for the index read below; the shards went up all the same
        columns=columns,
        compression=options.compression or None,
        size_limit=options.size_limit,
    ) as writer:
        for path in sorted(Path(options.parquet).glob("*.parquet")):
            parquet = pq.ParquetFile(path)
            for group in range(parquet.num_row_groups):
                for row in parquet.read_row_group(group).to_pylist():
                    writer.write(row)
                    samples += 1
    index = json.loads((Path(options.local) / "index.json").read_text())
    shards = index["shards"]
    print(
        json.dumps(
            {
                "samples": samples,
                "shards": len(shards),
                "zip_bytes": sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards),
                "raw_bytes": sum(s["raw_data"]["bytes"] for s in shards),
                "seconds": time.perf_counter() - started,
            }
        )
    )


def _read(options: argparse.Namespace) -> None:
    """One rank of a job, to the end of its epoch."""
    spawned = float(os.environ.get("BENCH_SPAWNED") or time.time())  # when the job started
    _stub_torchvision()
    import multiprocessing
    import zlib

    import numpy as np
    import torch
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    imported = time.time()
    dataset = StreamingDataset(
        remote=options.remote,
        local=options.local,
        batch_size=options.batch_size,
        shuffle=True,
        shuffle_seed=options.seed,
    )
    constructed = time.time()
    worker_started = multiprocessing.Array("d", options.workers, lock=False)

    def on_start(worker: int) -> None:
        worker_started[worker] = time.time()

    loader = DataLoader(
        dataset,
        batch_size=options.batch_size,
        num_workers=options.workers,
        worker_init_fn=on_start,
    )
    ids: list[Any] = []
    crcs: list[int] = []
    first = 0.0
    first_count = 0
    for batch in loader:
        ids.append(batch["id"])
        crcs.extend(zlib.crc32(text.encode()) for text in batch["text"])
        if not first:
            first = time.time()
            first_count = len(batch["text"])
        if options.max_batches and len(ids) >= options.max_batches:
            break
    ended = time.time()
    read = torch.cat(ids).numpy()
    np.save(options.ids_out, np.stack([read, np.asarray(crcs, dtype=np.int64)]))
    print(
        json.dumps(
            {
                "rank": int(os.environ["RANK"]),
                "spawned": spawned,
                "imported": imported,
                "constructed": constructed,
                "workers_started": max(worker_started),
                "first_batch": first,
                "ended": ended,
                "samples": len(read),
                "first_batch_samples": first_count,
            }
        )
    )


def _mds_read(options: argparse.Namespace) -> None:
    """Streaming's own MDS reader over a local folder of shards and its ``index.json``:
    every sample of every shard, in order, by ``Reader.get_item`` (a decoded dict), one
    untimed pass, then ``--passes`` timed ones; a JSON line per timed pass."""
    _stub_torchvision()
    from streaming.base.format import reader_from_json

    folder = options.folder
    shards = json.loads((Path(folder) / "index.json").read_text())["shards"]
    readers = [reader_from_json(folder, None, entry) for entry in shards]
    for timed in [False] + [True] * options.passes:
        count = 0
        started = time.perf_counter()
        for reader in readers:
            for i in range(reader.samples):
                reader.get_item(i)
                count += 1
        if timed:
            print(json.dumps({"samples": count, "seconds": time.perf_counter() - started}))


def main() -> None:
    """The commands of this script (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="streaming_side.py", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("setup", help="build the Streaming venv (run with chunkd's python)")
    commands.add_parser("requirements", help="Streaming's requirements, less torchvision")
    commands.add_parser("probe", help="import streaming; print its version and import time")
    convert = commands.add_parser("convert", help="Parquet files to MDS, uploaded by MDSWriter")
    convert.add_argument("--parquet", required=True)
    convert.add_argument("--local", required=True)
    convert.add_argument("--remote", required=True)
    convert.add_argument("--size-limit", type=int, default=1 << 26)
    convert.add_argument("--compression", default="")
    read = commands.add_parser("read", help="one rank of a job: a StreamingDataset to its end")
    read.add_argument("--remote", required=True)
    read.add_argument("--local", required=True)
    read.add_argument("--batch-size", type=int, required=True)
    read.add_argument("--workers", type=int, required=True)
    read.add_argument("--seed", type=int, default=17)
    read.add_argument("--max-batches", type=int, default=0)
    read.add_argument("--ids-out", required=True)
    mds = commands.add_parser("mds-read", help="Streaming's MDS reader over a local folder")
    mds.add_argument("--folder", required=True)
    mds.add_argument("--passes", type=int, default=3)
    options = parser.parse_args()
    if options.command == "setup":
        got = ensure_venv()
        print(got.reason if isinstance(got, Unavailable) else f"ready: {got.root}")
        raise SystemExit(1 if isinstance(got, Unavailable) else 0)
    {
        "requirements": lambda: _requirements(),
        "probe": lambda: _probe(),
        "convert": lambda: _convert(options),
        "read": lambda: _read(options),
        "mds-read": lambda: _mds_read(options),
    }[options.command]()


if __name__ == "__main__":
    main()
