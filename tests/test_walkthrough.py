"""The README's walkthrough, run as written, so that it cannot go stale.

Every fenced block of the README's section "Walkthrough on the embedded default" runs in
order, in a fresh working directory, against a fresh daemon on the embedded default:

* a ``sh`` block whose command is ``make run`` (with any ``VAR=value`` in front) starts
  the daemon as ``make run`` does (``.venv/bin/chunkd serve``, with those variables),
  stopping the one before; the Makefile's ``run`` recipe is checked to be just that;
* any other ``sh`` block runs in bash with the venv activated, as the second terminal;
* a ``python`` block runs as a script in the venv's python;
* a ``text`` block is what the block before it must print: each of its lines must be
  found, in order, among the output's lines (runs of spaces count as one, and ``…``
  stands for any text);
* each page link of the walkthrough (``<http://127.0.0.1:8470/...>``) is opened in
  headless Chromium, which must show it without an error.

The walkthrough names fixed ports (8470, 8471), so as root it runs in a network namespace
of its own (only its loopback: nothing leaves it), and elsewhere only when those ports are
free. No command's output may hold a traceback.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

from chunkd.testing.browser import chromium_missing
from chunkd.testing.daemon import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SECTION = "## Walkthrough on the embedded default"
VENV = ROOT / ".venv"

# What each page of the walkthrough must show once loaded (a link the README adds must
# be added here: the test fails on one it does not know).
PAGES = {
    "http://127.0.0.1:8470/": "backends local",  # the node line, from /v1/dashboard
    "http://127.0.0.1:8470/inspect/?dataset=demo": "4,000",  # demo@1's samples
    "http://127.0.0.1:8470/inspect/?open=local/demo/part-0.parquet": "score",
}


# Run in the walkthrough's namespace: opens each page, waits for its word, and says what
# the page shows when the word never comes.
PAGE_SCRIPT = """
import json, sys
from chunkd.testing.browser import chromium

pages = json.loads(sys.argv[1])
with chromium() as browser:
    for url, word in pages.items():
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        answer = page.goto(url)
        assert answer is not None and answer.status == 200, (url, answer)
        try:
            page.wait_for_function(
                "w => document.body.innerText.includes(w)", arg=word, timeout=15000
            )
        except Exception:
            sys.exit(f"{url} never showed {word!r}; it shows:\\n" + page.inner_text("body"))
        assert not errors, (url, errors)
        print("ok", url)
        page.close()
"""


@dataclass(frozen=True)
class Block:
    """One fenced block of the walkthrough: its info string, its text, and the step."""

    kind: str
    text: str
    step: str


def walkthrough() -> tuple[list[Block], list[str]]:
    """The walkthrough's fenced blocks in order, and its page links."""
    readme = README.read_text()
    start = readme.index(SECTION)
    end = readme.index("\n## ", start + len(SECTION))
    section = readme[start:end]
    blocks = []
    step = "intro"
    lines = section.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("### "):
            step = line[4:]
        if line.startswith("```") and len(line) > 3:
            kind = line[3:].strip()
            j = lines.index("```", i + 1)
            blocks.append(Block(kind, "\n".join(lines[i + 1 : j]) + "\n", step))
            i = j
        i += 1
    fences = [line for line in section.splitlines() if line.lstrip().startswith("```")]
    assert len(fences) == 2 * len(blocks), (
        "a fence with no language, or indented, in the walkthrough"
    )
    links = re.findall(r"<(http://127\.0\.0\.1:8470/[^>]*)>", section)
    return blocks, links


def expect(output: str, expected: str, what: str) -> None:
    """Each line of ``expected`` is found, in order, among ``output``'s lines."""

    def squeeze(line: str) -> str:
        return " ".join(line.split())

    got = [squeeze(line) for line in output.splitlines()]
    at = 0
    for want in filter(None, (squeeze(line) for line in expected.splitlines())):
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("…")))
        for k in range(at, len(got)):
            if pattern.fullmatch(got[k]) or pattern.fullmatch(got[k].strip()):
                at = k + 1
                break
        else:
            pytest.fail(f"{what}: expected a line {want!r} (in order) in:\n{output}")


class Namespace:
    """A network namespace with only its loopback (or none: the host's)."""

    def __init__(self) -> None:
        self.name: str | None = None
        if os.geteuid() == 0 and shutil.which("ip"):
            name = f"chunkd-walk-{secrets.token_hex(3)}"
            subprocess.run(["ip", "netns", "add", name], check=True)
            self.name = name
            self.argv(["ip", "link", "set", "lo", "up"])
        else:
            for port in (8470, 8471):
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        pytest.skip(f"port {port} is in use, and only root makes a namespace")

    def prefix(self) -> list[str]:
        return [] if self.name is None else ["ip", "netns", "exec", self.name]

    def argv(self, argv: list[str]) -> None:
        subprocess.run([*self.prefix(), *argv], check=True)

    def remove(self) -> None:
        if self.name is not None:
            subprocess.run(["ip", "netns", "del", self.name], check=False)


class Walk:
    """The two terminals: the daemon's and the user's, in one working directory."""

    def __init__(self, cwd: Path, ns: Namespace) -> None:
        self.cwd = cwd
        self.ns = ns
        self.daemon: DaemonProcess | None = None
        self.logs: list[Path] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CHUNKD_", "AWS_"))}
        self.env["HOME"] = str(cwd)  # no ~/.aws or ~/.config of the machine's

    def start(self, assignments: dict[str, str]) -> None:
        self.stop()
        log = self.cwd / f"daemon-{len(self.logs)}.log"
        self.logs.append(log)
        # The README's own daemon: the walkthrough's venv, its embedded default config,
        # the settings the README exports; ready when curl in its namespace says so.
        self.daemon = DaemonProcess(
            cwd=self.cwd,
            env=assignments,
            prefix=self.ns.prefix(),
            program=(str(VENV / "bin/chunkd"),),
            log=log,
            base_env=self.env,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            probe = self.run("sh", "curl -sf localhost:8470/readyz >/dev/null && echo ready")
            if probe.returncode == 0 and "ready" in probe.stdout:
                return
            if self.daemon.process.poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"the daemon did not become ready:\n{log.read_text()}")

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop(signal.SIGINT, timeout=20)  # Ctrl-C, as the README says
        self.daemon = None

    def run(self, kind: str, text: str) -> subprocess.CompletedProcess[str]:
        if kind == "python":
            script = self.cwd / "block.py"
            script.write_text(text)
            text = f"python {shlex.quote(str(script))}\n"
        program = f"source .venv/bin/activate\nset -e -o pipefail\n{text}"
        return subprocess.run(
            [*self.ns.prefix(), "bash", "-c", program],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )


@pytest.fixture
def walk(tmp_path: Path) -> Iterator[Walk]:
    if not (VENV / "bin/chunkd").exists():
        pytest.skip("no .venv: make run makes it")
    (tmp_path / ".venv").symlink_to(VENV)
    ns = Namespace()
    walk = Walk(tmp_path, ns)
    try:
        yield walk
    finally:
        walk.stop()
        ns.remove()


def daemon_start(block: Block) -> dict[str, str] | None:
    """The variables of a ``VAR=value ... make run`` block, or None for another block."""
    words = shlex.split(block.text.strip()) if block.kind == "sh" else []
    if words[-2:] != ["make", "run"] or not all("=" in word for word in words[:-2]):
        return None
    return dict(word.split("=", 1) for word in words[:-2])


def test_make_run_runs_chunkd_serve() -> None:
    # what the walkthrough's "make run" stands for here
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^run: .*\n\t(.+)$", makefile, re.MULTILINE)
    assert recipe is not None
    assert recipe.group(1).strip() == "$(BIN)/chunkd serve"


def check_pages(walk: Walk, links: list[str]) -> None:
    """Open each page link in headless Chromium, in the walkthrough's namespace."""
    unknown = sorted(set(links) - set(PAGES))
    assert not unknown, f"the README links pages this test does not know: {unknown}"
    missing = chromium_missing()
    if missing:
        pytest.skip(missing)
    script = walk.cwd / "pages.py"
    script.write_text(PAGE_SCRIPT)
    wanted = {url: PAGES[url] for url in links}
    # The test's own python (playwright is the test toolchain's, not the walkthrough's)
    shown = subprocess.run(
        [*walk.ns.prefix(), sys.executable, str(script), json.dumps(wanted)],
        cwd=walk.cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for url in links:
        assert f"ok {url}" in shown.stdout


@pytest.mark.timeout(300)
def test_the_readme_walkthrough_runs_as_written(walk: Walk) -> None:
    blocks, links = walkthrough()
    assert [b.kind for b in blocks if b.kind not in ("sh", "python", "text")] == []
    assert daemon_start(blocks[0]) == {}, "the walkthrough starts with make run"
    steps = {b.step for b in blocks}
    assert len([s for s in steps if s[:2] in ("1.", "2.", "3.", "4.", "5.")]) == 5
    last: tuple[Block, str] | None = None
    for block in blocks:
        if block.kind == "text":
            assert last is not None, f"a text block with no command before it ({block.step})"
            expect(last[1], block.text, f"{last[0].step}: {last[0].text.strip()[:60]}")
            continue
        assignments = daemon_start(block)
        if assignments is not None:
            walk.start(assignments)
            last = None
            continue
        done = walk.run(block.kind, block.text)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{block.step}: {block.text}\n{output}"
        assert "Traceback" not in output, f"{block.step}: {block.text}\n{output}"
        last = (block, output)
        if block.step.startswith("4.") and links:
            check_pages(walk, links)
            links = []
    assert not links, "the page links were not checked (no block in step 4)"
    walk.stop()
    for log in walk.logs:
        text = log.read_text()
        assert "Traceback" not in text, text
        assert '"level": "error"' not in text, text


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.timeout(30)
def test_every_link_of_the_readme_and_the_docs_resolves() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            if not path:
                if anchor not in anchors:
                    broken.append(f"{page.name}: #{anchor}")
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
    assert len(README.read_text().splitlines()) <= 250, "the README is meant to stay short"


def requirements_closure(roots: list[str]) -> set[str]:
    """The distributions that installing ``roots`` (``NAME`` or ``NAME[EXTRA,...]``)
    brings, found from the installed metadata."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [Requirement(root) for root in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        found.add(key[0])
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (a platform's own, say): brings nothing we use
        for text in requires:
            dep = Requirement(text)
            wanted = [{"extra": extra} for extra in req.extras] or [{"extra": ""}]
            if dep.marker is None or any(dep.marker.evaluate(env) for env in wanted):
                todo.append(dep)
    return found


@pytest.mark.timeout(30)
def test_the_walkthrough_needs_only_what_make_run_installs() -> None:
    # The walkthrough runs in CI on the test toolchain's venv, which holds far more than
    # `make run` installs: every module its Python imports must come from make run's
    # extras, or from a `pip install` the walkthrough itself says.
    from packaging.utils import canonicalize_name

    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(
        r"^\$\(RUN_STAMP\):.*?pip install --quiet -e '\.(\[[^\]]+\])'", makefile, re.M | re.S
    )
    assert extras is not None, "make run's pip install of chunkd's extras is not where it was"
    blocks, _ = walkthrough()
    asked = [
        word
        for block in blocks
        if block.kind == "sh"
        for line in block.text.splitlines()
        if line.startswith("pip install ")
        for word in line.split()[2:]
    ]
    have = requirements_closure([f"chunkd{extras.group(1)}", *asked])
    modules = metadata.packages_distributions()
    imported = set()
    for block in blocks:
        if block.kind != "python":
            continue
        for node in ast.walk(ast.parse(block.text)):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    missing = {
        name: modules.get(name)
        for name in imported - set(sys.stdlib_module_names)
        if name != "chunkd" and not {canonicalize_name(d) for d in modules.get(name, [])} & have
    }
    assert imported >= {"torch", "pyarrow", "boto3", "chunkd"}
    assert not {"pytest", "moto", "playwright"} & have  # the test toolchain is not in it
    assert not missing, f"the walkthrough imports what make run does not install: {missing}"
