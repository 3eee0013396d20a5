"""The inspector's page (``/inspect/``) in a real headless Chromium against a real daemon.

Every test writes real files under the daemon's ``local`` backend (``./chunkd-data``),
starts ``chunkd serve``, and drives Debian's Chromium through playwright's sync API (so
the tests are plain functions). What they check is what a user sees: rows that render
and page, images that decode, audio that plays and seeks by range, RL groups sorted by
reward, an episode's timeline, deep links, a malformed file's error, and hostile values
shown as text under the page's CSP.

``CHUNKD_SCREENSHOTS=1`` also retakes the README's screenshots
(``docs/images/inspector-*.png``, 1280 by 800).
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import subprocess
import sys
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest

from chunkd.testing.browser import chromium, chromium_missing

from .conftest import Daemon

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Response

_MISSING = chromium_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

MEDIA = Path(__file__).parent / "data" / "media"
DOCS_IMAGES = Path(__file__).parent.parent / "docs" / "images"
BIN = Path(sys.executable).parent
#: rows a page of the inspector's tables shows (PAGE_ROWS in inspect.js)
PAGE_ROWS = 20
#: rows of the Parquet fixture: three row groups, the last one short
PARQUET_ROWS = 45
#: the width of its pictures
PICTURE_WIDTH = 64
HOSTILE = {
    "script": "<script>window.__pwned=1</script>",
    "img": '<img src=x onerror="window.__pwned=1">',
    "url": "javascript:window.__pwned=1",
}
#: how long a test waits for the page to show something (ms)
WAIT_MS = 20_000


# -- fixture files -----------------------------------------------------------------------


def _png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def _picture(i: int) -> bytes:
    """Row ``i``'s 64x40 PNG: a hue of its own, a disc that moves along the rows."""
    import colorsys

    from PIL import Image, ImageDraw

    r, g, b = (int(255 * c) for c in colorsys.hsv_to_rgb(i / PARQUET_ROWS, 0.55, 0.95))
    image = Image.new("RGB", (PICTURE_WIDTH, 40), (r, g, b))
    x = 4 + i % 10 * 5
    ImageDraw.Draw(image).ellipse([x, 12, x + 14, 26], fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _write_parquet(path: Path, columns: dict[str, Any], row_group_size: int = 16) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def _images_parquet(path: Path) -> None:
    """45 rows in row groups of 16: an id, a caption (row 3's is 1,000 characters), a
    PNG image, a score and a ratio (``i / 7``: floats of 17 digits)."""
    captions = [f"caption of row {i}" for i in range(PARQUET_ROWS)]
    captions[3] = "long " + "x" * 990 + " end."
    _write_parquet(
        path,
        {
            "id": list(range(PARQUET_ROWS)),
            "caption": captions,
            "image": [_picture(i) for i in range(PARQUET_ROWS)],
            "score": [i / 10 for i in range(PARQUET_ROWS)],
            "ratio": [i / 7 for i in range(PARQUET_ROWS)],
        },
    )


#: rollouts: three groups of four, written out of reward order
ROLLOUT_REWARDS = {
    "g0": [0.1, 0.9, 0.5, -0.2],
    "g1": [0.3, 0.3, 1.5, 0.0],
    "g2": [2.0, -1.0, 0.7, 0.2],
}


def _rollouts_parquet(path: Path) -> None:
    prompts, completions, rewards, advantages, logprobs, groups = [], [], [], [], [], []
    for g, values in ROLLOUT_REWARDS.items():
        for j, reward in enumerate(values):
            prompts.append(f"Prompt of {g}: add {j} and {len(values)}.\nShow your work.")
            completions.append(f"completion {g}/{j} with reward {reward}\n" + "word " * 40)
            rewards.append(reward)
            advantages.append(round(reward - sum(values) / len(values), 4))
            logprobs.append([-0.05 * k for k in range(12 + j)])
            groups.append(g)
    _write_parquet(
        path,
        {
            "prompt": prompts,
            "completion": completions,
            "reward": rewards,
            "advantage": advantages,
            "logprobs": logprobs,
            "group": groups,
        },
    )


EPISODE_STEPS = 6


def _episodes_parquet(path: Path) -> None:
    """Two episodes of six steps; an image observation each step; done on the last."""
    cols: dict[str, list[Any]] = {
        k: [] for k in ("episode", "step", "observation", "action", "reward", "done")
    }
    for episode in range(2):
        for step in range(EPISODE_STEPS):
            cols["episode"].append(episode)
            cols["step"].append(step)
            cols["observation"].append(_png(32, 32, (40 * step, 120, 60 * episode)))
            cols["action"].append(step % 3)
            cols["reward"].append(float(step - 2) / 2 + episode)
            cols["done"].append(step == EPISODE_STEPS - 1)
    _write_parquet(path, cols)


def _wds_tar(path: Path, samples: int) -> None:
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(samples):
            for ext, data in (
                ("png", _png(20, 20, (200, 10 * i, 30))),
                ("json", json.dumps({"label": i, "note": f"sample {i}"}).encode()),
            ):
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _mds(folder: Path, samples: int) -> None:
    """One MDS shard and its ``index.json``, as Streaming's MDSWriter lays them out."""
    from .test_dataset_formats import mds_shard

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "text": f"mds sample {i}", "image": _picture(i)} for i in range(samples)]
    data, entry = mds_shard(
        {"id": "int", "text": "str", "image": "png"}, rows, "shard.00000.mds", None
    )
    (folder / "shard.00000.mds").write_bytes(data)
    (folder / "index.json").write_text(json.dumps({"version": 2, "shards": [entry]}))


def _long_wav(path: Path, seconds: int) -> None:
    """A WAV long enough that Chromium cannot have it all from its first range."""
    rate = 16_000
    frame = b"".join(
        int(8000 * math.sin(2 * math.pi * 440 * i / rate)).to_bytes(2, "little", signed=True)
        for i in range(rate)
    )
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        for _ in range(seconds):
            out.writeframes(frame)


def _fill(root: Path) -> None:
    """Every fixture file, under the daemon's ``local`` backend."""
    root.mkdir(parents=True, exist_ok=True)
    _images_parquet(root / "x.parquet")
    _rollouts_parquet(root / "rl" / "rollouts.parquet")
    _episodes_parquet(root / "rl" / "episodes.parquet")
    (root / "bad.parquet").write_bytes(b"PAR1" + b"\x15\x04not a parquet footer at all" + b"PAR1")
    hostile_row = {**HOSTILE, HOSTILE["img"]: "a key that is markup"}
    (root / "hostile.jsonl").write_text(
        json.dumps(hostile_row) + "\n" + json.dumps({"n": 2}) + "\n"
    )
    _write_parquet(root / "hostile.parquet", {k: [v, v] for k, v in HOSTILE.items()})
    notes = [{"id": i, "text": f"note {i} " * (80 if i == 1 else 2)} for i in range(5)]
    (root / "notes.jsonl").write_text("".join(json.dumps(n) + "\n" for n in notes))
    (root / "poem.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(50)))
    _wds_tar(root / "wds" / "shard-000000.tar", 5)
    _mds(root / "mds", 30)
    _write_parquet(
        root / "sounds.parquet",
        {
            "name": ["tone.wav", "tone.ogg"],
            "audio": [(MEDIA / "tone.wav").read_bytes(), (MEDIA / "tone.ogg").read_bytes()],
        },
    )
    shutil.copytree(MEDIA, root / "media")
    many = root / "many"
    many.mkdir()
    for i in range(250):
        (many / f"f{i:04d}.txt").write_text(str(i))


# -- the browser and the page --------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as found:
        yield found


@pytest.fixture
def node(start_daemon: Callable[..., Daemon], tmp_path: Path) -> Daemon:
    """A daemon on its embedded default config over every fixture file."""
    _fill(tmp_path / "chunkd-data")
    return start_daemon()


@dataclass
class Tab:
    """A page on the inspector, with what its console said."""

    page: Page
    daemon: Daemon
    errors: list[str] = field(default_factory=list)
    responses: list[Response] = field(default_factory=list)

    def open(self, query: str = "") -> Response | None:
        """Load ``/inspect/?QUERY`` and wait until the view is shown."""
        response = self.page.goto(f"{self.daemon.url}/inspect/{'?' + query if query else ''}")
        self.page.wait_for_selector("#view[data-ready]", timeout=WAIT_MS)
        return response

    def assert_clean(self) -> None:
        assert self.errors == [], f"the console saw errors: {self.errors}"

    def text(self, selector: str) -> str:
        return self.page.locator(selector).first.inner_text(timeout=WAIT_MS)


@pytest.fixture
def tab(browser: Browser, node: Daemon) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    found = Tab(page, node)
    page.on("console", lambda m: found.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: found.errors.append(f"pageerror: {e}"))
    page.on("response", lambda r: found.responses.append(r))
    yield found
    context.close()


def _loaded_image(page: Page, selector: str) -> int:
    """The naturalWidth of the first image matching ``selector``, once it has loaded."""
    page.wait_for_function(
        "s => { const i = document.querySelector(s);"
        " return i && i.complete && i.naturalWidth > 0 }",
        arg=selector,
        timeout=WAIT_MS,
    )
    return int(page.eval_on_selector(selector, "i => i.naturalWidth"))


def _row_indexes(page: Page) -> list[int]:
    return [
        int(i)
        for i in page.eval_on_selector_all(
            ".rows-table [data-index]", "rs => rs.map(r => r.dataset.index)"
        )
    ]


# -- Parquet ---------------------------------------------------------------------------


def test_parquet_rows_page_to_the_last_and_images_load(tab: Tab) -> None:
    page = tab.page
    response = tab.open("open=local/x.parquet")
    assert response is not None
    assert response.status == 200
    assert _row_indexes(page) == list(range(PAGE_ROWS))
    assert f"of {PARQUET_ROWS}" in tab.text(".rows-panel .status")
    # an image cell is an <img> from the cell's bytes, and it decodes
    assert _loaded_image(page, ".rows-table tr[data-index='0'] img.cell-media") == PICTURE_WIDTH
    assert page.eval_on_selector(
        ".rows-table img.cell-media", "i => i.src.startsWith('data:image/png;base64,')"
    )

    page.click("button[data-page='last']")
    page.wait_for_selector(f".rows-table tr[data-index='{PARQUET_ROWS - 1}']")
    assert _row_indexes(page) == list(range(40, PARQUET_ROWS))
    assert "start=40" in page.url
    assert page.is_disabled("button[data-page='next']")
    assert (
        _loaded_image(page, f".rows-table tr[data-index='{PARQUET_ROWS - 1}'] img.cell-media")
        == PICTURE_WIDTH
    )

    # "go to row N" computes the page's start and marks the row
    page.fill("#goto-row", "30")
    page.click(".goto button[type='submit']")
    page.wait_for_selector(".rows-table tr[data-index='30'].focus")
    assert _row_indexes(page) == list(range(20, 40))
    page.click("button[data-page='prev']")
    page.wait_for_selector(".rows-table tr[data-index='0']")

    # each page went into the history: back goes to the one before
    page.go_back()
    page.wait_for_selector(".rows-table tr[data-index='30']")
    assert "start=20" in page.url

    # a long string shows its start and a toggle that shows it all
    page.click("button[data-page='first']")
    cell = page.locator(".rows-table tr[data-index='3'] td").nth(2)
    assert " end." not in cell.inner_text()
    cell.locator(".fold-toggle").click()
    assert cell.inner_text().count("x") >= 990
    assert " end." in cell.inner_text()
    tab.assert_clean()


def test_parquet_structure_shows_schema_and_row_group_statistics(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/x.parquet&tab=structure")
    schema = tab.text("table.schema")
    for column in ("id", "caption", "image", "score"):
        assert column in schema
    groups = page.locator("details.row-group")
    assert groups.count() == 3
    groups.nth(2).locator("summary").click()
    stats = groups.nth(2).inner_text()
    # the last group's id min and max
    assert "32" in stats
    assert "44" in stats
    tab.assert_clean()


def test_deep_link_to_a_row_of_an_object(tab: Tab) -> None:
    page = tab.page
    tab.open("sample=" + quote("local/x.parquet#17", safe=""))
    sample = page.locator("section.sample")
    assert sample.get_attribute("data-index") == "17"
    assert '"id": 17' in sample.inner_text()
    assert "caption of row 17" in sample.inner_text()
    _loaded_image(page, "section.sample img")
    # from the sample to its page of the object, that row marked
    page.click("section.sample a[href*='open=']")
    page.wait_for_selector(".rows-table tr[data-index='17'].focus")
    tab.assert_clean()


def test_a_malformed_parquet_file_shows_its_error_and_the_page_stays_usable(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/bad.parquet")
    box = page.locator("#error")
    assert box.is_visible()
    assert tab.text("#error-kind") == "MalformedFileError"
    # the daemon's message, whole: what it read and what is wrong
    assert "local/bad.parquet" in tab.text("#error-message")
    assert "footer" in tab.text("#error-message")
    # the file can still be looked at as bytes
    page.click("section.failed a[href*='format=binary']")
    page.wait_for_selector("pre.hex")
    assert "PAR1" in tab.text("pre.hex")
    assert not box.is_visible()
    # and the rest of the page works: back to the listing of the backend
    page.go_back()
    page.wait_for_selector("section.failed")
    assert box.is_visible()
    page.click("section.failed a[href*='list=']")
    page.wait_for_selector("table.listing a[href*='x.parquet']")
    assert not box.is_visible()
    page.click("table.listing a[href$='open=local%2Fx.parquet']")
    page.wait_for_selector(".rows-table tr[data-index='0']")


def _box(page: Page, selector: str) -> dict[str, float]:
    """Where the first element matching ``selector`` is on screen (CSS pixels)."""
    box: dict[str, float] = page.eval_on_selector(
        selector,
        "e => { const r = e.getBoundingClientRect();"
        " return {top: r.top, bottom: r.bottom, left: r.left, width: r.width, height: r.height,"
        " viewport: innerHeight} }",
    )
    return box


@pytest.mark.timeout(60)
def test_a_thumbnail_is_big_and_enlarges_on_click(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/x.parquet")
    thumb = ".rows-table tr[data-index='2'] img.cell-media"
    assert _loaded_image(page, thumb) == PICTURE_WIDTH
    # a 64 px picture shows at least twice its size in the table
    assert _box(page, thumb)["width"] >= 2 * PICTURE_WIDTH
    lightbox = page.locator("dialog#lightbox")
    assert not lightbox.is_visible()
    page.click(thumb)
    lightbox.wait_for(state="visible")
    assert page.get_attribute("#lightbox-img", "src") == page.get_attribute(thumb, "src")
    _loaded_image(page, "#lightbox-img")
    assert _box(page, "#lightbox-img")["width"] >= 500  # enlarged: well past the thumbnail
    assert "64 \u00d7 40 px" in tab.text("#lightbox-caption")
    assert "image/png" in tab.text("#lightbox-caption")
    page.keyboard.press("Escape")
    lightbox.wait_for(state="hidden")
    # a click beside the picture (on the backdrop) closes it too, and so does the close button
    page.click(thumb)
    lightbox.wait_for(state="visible")
    page.mouse.click(5, 795)
    lightbox.wait_for(state="hidden")
    page.click(thumb)
    page.click("#lightbox-close")
    lightbox.wait_for(state="hidden")
    # from the keyboard: a thumbnail takes the focus, Enter enlarges it
    page.focus(thumb)
    page.keyboard.press("Enter")
    lightbox.wait_for(state="visible")
    page.keyboard.press("Escape")
    lightbox.wait_for(state="hidden")
    tab.assert_clean()


@pytest.mark.timeout(60)
def test_floats_show_four_significant_digits_and_their_whole_value_on_hover(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/x.parquet")
    cells = page.locator(".rows-table tr[data-index='1'] td")
    ratio = cells.nth(5).locator(".j-num")  # #, id, caption, image, score, ratio
    assert ratio.inner_text() == "0.1429"
    assert ratio.get_attribute("title") == repr(1 / 7)
    # numbers that are short already are shown as they are, with no tooltip
    assert cells.nth(4).inner_text() == "0.1"
    assert cells.nth(1).inner_text() == "1"
    assert page.locator(".rows-table tr[data-index='19'] td").nth(5).inner_text() == "2.714"
    # the statistics of the structure tab too
    tab.open("open=local/x.parquet&tab=structure")
    page.locator("details.row-group summary").first.click()
    assert "2.143" in tab.text("details.row-group table.stats")  # row 15's ratio, 15 / 7
    assert repr(15 / 7) not in tab.text("details.row-group table.stats")
    # the sample's own view shows every digit
    tab.open("sample=" + quote("local/x.parquet#1", safe=""))
    assert f'"ratio": {1 / 7!r}' in tab.text("section.sample")
    tab.assert_clean()


@pytest.mark.timeout(60)
def test_the_pager_stays_in_view_after_a_jump(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/x.parquet")
    page.fill("#goto-row", "30")
    page.click(".goto button[type='submit']")
    page.wait_for_selector(".rows-table tr[data-index='30'].focus")
    page.wait_for_function("() => window.scrollY > 0")  # the row was scrolled to
    page.wait_for_timeout(100)
    pager = _box(page, ".rows-panel > .pager")
    assert pager["top"] >= 0, pager
    assert pager["bottom"] <= pager["viewport"], pager
    row = _box(page, ".rows-table tr[data-index='30']")
    assert row["top"] >= pager["bottom"] - 1, (row, pager)  # the row is not under it
    assert row["bottom"] <= row["viewport"]
    # nothing covers it: what is at its middle is the pager
    assert page.evaluate(
        "() => { const p = document.querySelector('.rows-panel > .pager');"
        " const r = p.getBoundingClientRect();"
        " return p.contains(document.elementFromPoint(r.left + 5, r.top + r.height / 2)) }"
    )
    tab.assert_clean()


@pytest.mark.timeout(60)
def test_rollouts_sit_side_by_side_with_a_legend_and_reward_colours(tab: Tab) -> None:
    page = tab.page
    tab.open("open=" + quote("local/rl/rollouts.parquet", safe="") + "&tab=rl")
    page.locator(".rl-group").first.wait_for()
    first = page.locator(".rl-group").first.locator(".rollout")
    a, b = first.nth(0).bounding_box(), first.nth(1).bounding_box()
    assert a is not None
    assert b is not None
    assert abs(a["y"] - b["y"]) < 1  # one row of the grid
    assert b["x"] > a["x"] + a["width"] - 1
    # a legend says what the logprob strip's bars are, and the reward scale
    legend = tab.text(".logprob-legend")
    assert "probability" in legend
    assert "p < 0.5" in legend
    ends = page.locator(".reward-legend .mono").all_inner_texts()
    assert ends == ["-1", "2"]  # the page's lowest and highest reward
    # rewards are coloured on the page's scale, the level said in words too
    lowest = page.locator(".rollout[data-reward='-1']")
    highest = page.locator(".rollout[data-reward='2']")
    assert "reward-0" in (lowest.get_attribute("class") or "")
    assert "reward-4" in (highest.get_attribute("class") or "")
    assert "very low" in lowest.locator(".reward-badge").inner_text()
    assert "very high" in highest.locator(".reward-badge").inner_text()
    colours = [
        loc.locator(".reward-badge").evaluate("e => getComputedStyle(e).backgroundColor")
        for loc in (lowest, highest)
    ]
    assert colours[0] != colours[1]
    border = lowest.evaluate("e => getComputedStyle(e).borderLeftColor")
    assert border != highest.evaluate("e => getComputedStyle(e).borderLeftColor")
    # each strip says its numbers in words
    assert "mean" in first.nth(0).locator(".logprob-list summary").inner_text()
    # narrow: one under the other
    page.set_viewport_size({"width": 560, "height": 800})
    page.wait_for_timeout(100)
    a, b = first.nth(0).bounding_box(), first.nth(1).bounding_box()
    assert a is not None
    assert b is not None
    assert b["y"] >= a["y"] + a["height"] - 1
    tab.assert_clean()


@pytest.mark.timeout(60)
def test_the_audio_view_says_duration_rate_and_channels(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/media/tone.wav")
    facts = tab.text(".audio-facts")
    assert "1.00 s" in facts
    assert "8 kHz" in facts
    assert "1 (mono)" in facts
    assert "pcm" in facts
    tab.open("open=local/media/tone.flac")
    assert "8 kHz" in tab.text(".audio-facts")
    # an audio cell says it beside its player
    tab.open("open=local/sounds.parquet")
    labels = page.locator(".rows-table .bytes-label")
    labels.first.wait_for()
    assert "1.00 s · 8 kHz · mono" in labels.nth(0).inner_text()
    assert "1.00 s · 16 kHz · mono" in labels.nth(1).inner_text()  # tone.ogg: Opus
    tab.assert_clean()


@pytest.mark.timeout(60)
def test_the_landing_page_works_on_a_config_without_a_local_backend(
    browser: Browser, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "elsewhere"
    data.mkdir()
    (data / "hello.txt").write_text("hello\n")
    daemon = start_daemon(f'[[backends]]\nname = "data"\nurl = "file://{data}"\n')
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        found = Tab(context.new_page(), daemon)
        page = found.page
        page.on("pageerror", lambda e: found.errors.append(f"pageerror: {e}"))
        for query in ("", "view=datasets"):
            found.open(query)
            assert page.locator("#error").is_hidden()
            datasets = found.text("section.datasets")
            assert "could not" not in datasets
            assert '[datasets]\nregistry = "data/datasets"' in found.text(".registry-missing pre")
        found.open()
        assert found.text("section.backends table").count("data") == 1
        assert "local" not in found.text("section.backends")
        page.click(".start-here a.first-backend")
        page.wait_for_selector("table.listing a[href$='open=data%2Fhello.txt']")
        found.assert_clean()
    finally:
        context.close()


# -- other formats ---------------------------------------------------------------------


def test_jsonl_is_pretty_with_long_strings_folded(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/notes.jsonl")
    assert _row_indexes(page) == [0, 1, 2, 3, 4]
    record = page.locator(".record[data-index='1']")
    assert '"id": 1' in record.inner_text()
    full = "note 1 " * 80
    assert full.strip() not in record.inner_text()
    record.locator(".fold-toggle").click()
    assert full.strip() in record.inner_text()
    record.locator(".fold-toggle").click()
    assert full.strip() not in record.inner_text()
    tab.assert_clean()


def test_text_shows_lines_a_page_at_a_time(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/poem.txt")
    assert _row_indexes(page) == list(range(PAGE_ROWS))
    assert "line 0: the quick brown fox" in tab.text(".rows-table")
    page.click("button[data-page='next']")
    page.wait_for_selector(".rows-table tr[data-index='39']")
    assert "line 39:" in tab.text(".rows-table tr[data-index='39']")
    tab.assert_clean()


def test_webdataset_samples_show_their_image_from_the_media_route(tab: Tab) -> None:
    page = tab.page
    tab.open("open=" + quote("local/wds/shard-000000.tar", safe=""))
    assert _row_indexes(page) == [0, 1, 2, 3, 4]
    record = page.locator(".record[data-index='2']")
    assert '"label": 2' in record.inner_text()
    src = record.locator("img").get_attribute("src") or ""
    assert src.startswith("/v1/inspect/media/local/wds/shard-000000.tar?offset=")
    assert _loaded_image(page, ".record[data-index='2'] img") == 20
    tab.assert_clean()


def test_mds_rows_show_columns_and_images(tab: Tab) -> None:
    page = tab.page
    tab.open("open=" + quote("local/mds/shard.00000.mds", safe=""))
    assert _row_indexes(page) == list(range(PAGE_ROWS))
    assert "of 30" in tab.text(".rows-panel .status")
    assert "mds sample 7" in tab.text(".rows-table tr[data-index='7']")
    assert _loaded_image(page, ".rows-table tr[data-index='7'] img.cell-media") == PICTURE_WIDTH
    page.click("button[data-page='last']")
    page.wait_for_selector(".rows-table tr[data-index='29']")
    tab.assert_clean()


# -- media -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["picture.png", "picture.jpg", "picture.webp"])
def test_an_image_file_shows_inline(tab: Tab, name: str) -> None:
    tab.open(f"open=local/media/{name}")
    assert _loaded_image(tab.page, "img.media.whole") == 48
    src = tab.page.get_attribute("img.media.whole", "src") or ""
    assert src.startswith(f"/v1/inspect/media/local/media/{name}")
    tab.assert_clean()


# Every fixture plays in Debian's Chromium (tests/data/media/README.md). WebM is sniffed
# as video/webm whatever it holds, so the audio-only one plays in a <video>.
_PLAYABLE = [
    ("tone.wav", "audio"),
    ("tone.flac", "audio"),
    ("tone.mp3", "audio"),
    ("tone.ogg", "audio"),
    ("tone.webm", "video"),
    ("clip.mp4", "video"),
    ("clip.webm", "video"),
]


@pytest.mark.parametrize(("name", "tag"), _PLAYABLE)
def test_audio_and_video_files_load_with_their_duration(tab: Tab, name: str, tag: str) -> None:
    page = tab.page
    tab.open(f"open=local/media/{name}")
    selector = f"{tag}.media.whole"
    page.wait_for_function(
        "s => { const m = document.querySelector(s); return m && (m.readyState >= 1 || m.error) }",
        arg=selector,
    )
    state = page.eval_on_selector(
        selector,
        "m => ({ready: m.readyState, duration: m.duration, error: m.error && m.error.message,"
        " width: m.videoWidth})",
    )
    assert state["error"] is None, state
    assert state["ready"] >= 1
    assert abs(state["duration"] - 1.0) < 0.05, state
    if name.startswith("clip"):
        assert state["width"] == 64
    tab.assert_clean()


def test_audio_cells_play_from_their_bytes(tab: Tab) -> None:
    page = tab.page
    tab.open("open=local/sounds.parquet")
    page.wait_for_function(
        "() => { const a = [...document.querySelectorAll('audio.cell-media')];"
        " return a.length === 2 && a.every(m => m.readyState >= 1 || m.error) }"
    )
    for state in page.eval_on_selector_all(
        "audio.cell-media",
        "ms => ms.map(m => ({src: m.src, duration: m.duration,"
        " error: m.error && m.error.message}))",
    ):
        assert state["error"] is None, state
        assert state["src"].startswith(
            "blob:"
        )  # built from the cell's bytes (CSP: media-src blob:)
        assert abs(state["duration"] - 1.0) < 0.05, state
    tab.assert_clean()


def test_seeking_audio_fetches_a_range_the_daemon_answers_206(tab: Tab) -> None:
    page = tab.page
    _long_wav(tab.daemon.cwd / "chunkd-data" / "media" / "long.wav", 120)
    tab.open("open=local/media/long.wav")
    page.wait_for_function(
        "() => { const a = document.querySelector('audio.media'); return a && a.readyState >= 1 }"
    )
    assert abs(page.eval_on_selector("audio.media", "a => a.duration") - 120) < 0.1

    def media_ranges() -> list[tuple[str | None, int]]:
        return [
            (r.request.headers.get("range"), r.status)
            for r in tab.responses
            if "/v1/inspect/media/local/media/long.wav" in r.url
        ]

    before = len(media_ranges())
    # seeking ends once the data at the new place has come: a range of its own
    page.eval_on_selector(
        "audio.media",
        "a => new Promise(done => {"
        " a.addEventListener('seeked', done, {once: true}); a.currentTime = 100 })",
    )
    page.wait_for_timeout(200)  # let the last response event arrive
    after = media_ranges()[before:]
    assert after, f"seeking fetched nothing: {media_ranges()}"
    ranged = [(r, s) for r, s in after if r is not None and not r.startswith("bytes=0-")]
    assert ranged, f"no range past the start after a seek: {after}"
    assert all(status == 206 for _, status in ranged), after
    # the daemon's answer says where it is in the file
    answer = next(r for r in reversed(tab.responses) if "long.wav" in r.url and r.status == 206)
    assert answer.headers["content-range"].startswith("bytes ")
    assert answer.headers["content-type"] == "audio/wav"
    tab.assert_clean()


# -- RL --------------------------------------------------------------------------------


def test_rollouts_are_grouped_and_sorted_by_reward(tab: Tab) -> None:
    page = tab.page
    tab.open("open=" + quote("local/rl/rollouts.parquet", safe="") + "&tab=rl")
    groups = page.locator(".rl-group")
    groups.first.wait_for()
    assert groups.count() == len(ROLLOUT_REWARDS)
    for i, (group, rewards) in enumerate(ROLLOUT_REWARDS.items()):
        box = groups.nth(i)
        assert group in box.locator(".rl-group-head").inner_text()
        assert f"Prompt of {group}" in box.locator(".rl-prompt").inner_text()
        shown = [
            float(r)
            for r in box.locator(".rollout").evaluate_all("rs => rs.map(r => r.dataset.reward)")
        ]
        assert shown == sorted(rewards, reverse=True)
        best = box.locator(".rollout").first
        assert f"reward {max(rewards)}" in best.locator(".completion").inner_text()
        # completions are shown whole, and each has its per-token logprobs
        assert best.locator(".completion").inner_text().count("word") == 40
        assert best.locator(".logprob-strip rect").count() >= 12
    tab.assert_clean()


def test_an_episode_shows_its_steps_and_a_timeline_to_jump_by(tab: Tab) -> None:
    page = tab.page
    tab.open("open=" + quote("local/rl/episodes.parquet", safe="") + "&tab=rl")
    episodes = page.locator(".episode")
    episodes.first.wait_for()
    assert episodes.count() == 2
    first = episodes.first
    steps = first.locator("svg.timeline .tl-step")
    assert steps.count() == EPISODE_STEPS
    assert first.locator("svg.timeline .tl-done").count() == 1  # done on the last step
    assert first.locator(".step-detail").get_attribute("data-step") == "0"
    steps.nth(3).click()
    detail = first.locator(".step-detail[data-step='3']")
    detail.wait_for()
    assert "step 3" in detail.inner_text()
    assert "0.5" in detail.inner_text()  # step 3's reward: (3 - 2) / 2
    _loaded_image(page, ".episode .step-detail[data-step='3'] img")
    first.locator(".step-detail button[data-go='next']").click()
    first.locator(".step-detail[data-step='4']").wait_for()
    tab.assert_clean()


# -- browsing --------------------------------------------------------------------------


def test_browse_a_backend_and_page_a_long_listing(tab: Tab) -> None:
    page = tab.page
    tab.open()
    page.click("a[href$='list=local']")
    page.wait_for_selector("table.listing a.dir[href$='list=local%2Fmany']")
    page.click("table.listing a.dir[href$='list=local%2Fmany']")
    page.wait_for_selector("table.listing a[href*='f0000.txt']")
    assert page.locator("table.listing tbody tr").count() == 200
    page.click("button.more")
    page.wait_for_selector("table.listing a[href*='f0249.txt']")
    assert page.locator("table.listing tbody tr").count() == 250
    assert page.locator("button.more").is_hidden()
    page.click("table.listing a[href*='f0249.txt']")
    page.wait_for_selector(".rows-table tr[data-index='0']")
    assert "249" in tab.text(".rows-table")
    # a recursive listing shows the keys below the folders too
    tab.open("list=local")
    assert page.locator("a[href$='open=local%2Fmany%2Ff0000.txt']").count() == 0
    page.check("label.recursive input")
    page.wait_for_selector("table.listing a[href$='open=local%2Fmany%2Ff0000.txt']")
    assert "recursive=true" in page.url
    tab.assert_clean()


def test_a_registered_dataset_its_versions_members_samples_and_a_step(tab: Tab) -> None:
    page = tab.page
    root = tab.daemon.cwd / "chunkd-data"
    for part in range(2):
        _write_parquet(
            root / "ds" / f"part-{part}.parquet", {"id": list(range(part * 10, part * 10 + 10))}
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(tab.daemon.cwd / "chunkd.sock")

    def register() -> None:
        done = subprocess.run(
            [str(BIN / "chunkd"), "dataset", "register", "pets", "local/ds/"],
            capture_output=True,
            text=True,
            env=env,
            timeout=110,
            check=False,
        )
        assert done.returncode == 0, done.stderr

    register()
    _write_parquet(root / "ds" / "part-2.parquet", {"id": list(range(20, 25))})
    register()

    tab.open("view=datasets")
    page.click("a[href$='dataset=pets']")
    page.wait_for_selector("a[href*='snapshot=pets%401']")
    # version 2 added a member: its diff with version 1 says so
    page.click("a[href*='diff=pets%401..pets%402']")
    page.wait_for_selector("ul.diff-added li")
    assert "part-2.parquet" in tab.text("ul.diff-added")
    page.go_back()
    page.click("a[href*='snapshot=pets%401']")
    members = page.locator("table.members tbody tr")
    members.first.wait_for()
    assert members.count() == 2
    assert "part-1.parquet" in members.nth(1).inner_text()
    page.click("table.members a[href*='sample=pets%401%2310']")
    # the snapshot's sample 10 is the first row of its second member
    sample = page.locator("section.sample[data-global='10']")
    sample.wait_for()
    assert sample.get_attribute("data-index") == "0"
    assert '"id": 10' in sample.inner_text()
    assert "local/ds/part-1.parquet" in sample.inner_text()

    # A link that opens the dataset by its name shows the snapshot, as its own link does.
    tab.open("open=pets%401")
    page.locator("table.members tbody tr").first.wait_for()
    assert page.locator("table.members tbody tr").count() == 2

    tab.open("step=0&ref=pets%401&seed=3&batch_size=4&world_size=2")
    ranks = page.locator("section.rank")
    assert ranks.count() == 2
    for r in range(2):
        rank = ranks.nth(r)
        rank.locator("section.sample").nth(3).wait_for()
        assert rank.locator("section.sample").count() == 4
        assert rank.locator("ol.ids li").count() == 4
    tab.assert_clean()


def _chunkd(daemon: Daemon, *args: str) -> str:
    """Run ``chunkd ARGS`` against ``daemon``; its stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKD_")}
    env["CHUNKD_SOCKET"] = str(daemon.cwd / "chunkd.sock")
    done = subprocess.run(
        [str(BIN / "chunkd"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _snapshot_id(daemon: Daemon, ref: str) -> str:
    import urllib.request

    url = f"{daemon.url}/v1/inspect/snapshot?ref={quote(ref, safe='')}&count=1"
    with urllib.request.urlopen(url, timeout=30) as answer:
        found: str = json.load(answer)["snapshot"]
    return found


@pytest.mark.timeout(90)
def test_every_deep_link_parameter_works_by_name_tag_version_and_id(tab: Tab) -> None:
    """Each parameter docs/inspector.md lists under "Deep links", with a dataset named
    each way it can be: NAME (its latest), NAME@V, NAME@TAG and the snapshot's id."""
    page = tab.page
    root = tab.daemon.cwd / "chunkd-data"
    for part in range(2):
        _write_parquet(
            root / "ds" / f"part-{part}.parquet", {"id": list(range(part * 20, part * 20 + 20))}
        )
    _chunkd(tab.daemon, "dataset", "register", "pets", "local/ds/")
    # names with '/': text/web (its first segment no backend) and local/pets (no such
    # object in backend local), registered in-process (a subprocess each is slower)
    from chunkd.client import Client
    from chunkd.client.datasets.register import commit, scan_prefix

    with Client(tab.daemon.cwd / "chunkd.sock") as client:
        commit(client, "text/web", scan_prefix(client, "local/ds/"))
        _write_parquet(root / "ds" / "part-2.parquet", {"id": list(range(40, 45))})
        later = scan_prefix(client, "local/ds/")
        commit(client, "text/web", later)
        commit(client, "local/pets", later)
    _chunkd(tab.daemon, "dataset", "register", "pets", "local/ds/")
    _chunkd(tab.daemon, "dataset", "tag", "pets@1", "gold")
    (root / "grpo").mkdir()
    shutil.copy(root / "rl" / "rollouts.parquet", root / "grpo" / "rollouts.parquet")
    _chunkd(tab.daemon, "dataset", "register", "grpo", "local/grpo/")
    first = _snapshot_id(tab.daemon, "pets@1")
    grpo = _snapshot_id(tab.daemon, "grpo")
    v1 = ("pets@1", "pets@gold", first)  # three names of version 1
    q = lambda ref: quote(ref, safe="")  # noqa: E731

    def members(query: str) -> int:
        tab.open(query)
        page.locator("table.members tbody tr").first.wait_for()
        return page.locator("table.members tbody tr").count()

    # ?open= and ?snapshot=: the snapshot, its members by default
    assert members("open=pets") == 3  # the latest: version 2
    assert members("snapshot=pets") == 3
    for ref in v1:
        assert members(f"open={q(ref)}") == 2, ref
        assert members(f"snapshot={q(ref)}") == 2, ref

    # ?dataset=: the versions, the one named marked
    tab.open("dataset=pets")
    assert page.locator("tr[data-version]").count() == 2
    for ref in v1:
        tab.open(f"dataset={q(ref)}")
        assert page.locator("tr[data-version='1'].focus").count() == 1, ref

    # ?list=: the folder a snapshot was registered from
    for ref in ("pets", *v1):
        tab.open(f"list={q(ref)}")
        page.wait_for_selector("table.listing a[href$='open=local%2Fds%2Fpart-0.parquet']")
        shown = tab.text(".snapshot-folder")
        assert f"the folder of {first if ref == first else 'pets@'}" in shown, ref

    # ?sample=: a sample by its global index
    for ref in ("pets", *v1):
        tab.open("sample=" + q(f"{ref}#21"))
        sample = page.locator("section.sample[data-global='21']")
        assert '"id": 21' in sample.inner_text(), ref
        assert sample.get_attribute("data-index") == "1"  # row 1 of part-1

    # a dataset whose name has '/' takes every parameter a dataset does
    assert members("open=text/web") == 3
    assert members("open=" + q("text/web@1")) == 2
    assert members("snapshot=text/web") == 3
    assert members("open=local/pets") == 3  # no object local/pets: the dataset
    tab.open("dataset=text/web")
    assert page.locator("tr[data-version]").count() == 2
    tab.open("dataset=" + q("text/web@1"))
    assert page.locator("tr[data-version='1'].focus").count() == 1
    for ref in ("text/web", "text/web@2", "local/pets"):
        tab.open("list=" + q(ref))
        page.wait_for_selector("table.listing a[href$='open=local%2Fds%2Fpart-0.parquet']")
        assert "the folder of " in tab.text(".snapshot-folder"), ref
    for ref in ("text/web", "text/web@1", "local/pets"):
        tab.open("sample=" + q(f"{ref}#21"))
        assert '"id": 21' in page.locator("section.sample[data-global='21']").inner_text(), ref
    tab.open("step=1&ref=" + q("text/web") + "&seed=3&batch_size=4&world_size=2")
    assert page.locator("section.rank").count() == 2
    tab.open("diff=" + q("text/web@1") + ".." + q("text/web"))
    assert "part-2.parquet" in tab.text("ul.diff-added")
    # objects stay objects: a key in backend local, and its folder
    tab.open("open=local/ds/part-0.parquet")
    assert _row_indexes(page) == list(range(20))
    tab.open("list=local/ds")
    page.wait_for_selector("table.listing a[href$='open=local%2Fds%2Fpart-0.parquet']")
    assert page.locator(".snapshot-folder").count() == 0

    # ?step= with ?ref= (and seed, epoch, batch_size, world_size, rank)
    for ref in ("pets", *v1):
        tab.open(f"step=1&ref={q(ref)}&seed=3&epoch=0&batch_size=4&world_size=2")
        assert page.locator("section.rank").count() == 2, ref
        page.locator("section.rank").nth(1).locator("section.sample").nth(3).wait_for()
    tab.open(f"step=0&ref={q(first)}&seed=3&batch_size=4&world_size=2&rank=1&tail=pad")
    assert page.locator("section.rank").count() == 1
    assert page.locator("section.rank").get_attribute("data-rank") == "1"

    # ?diff=A..B, each side any name
    for a, b in (("pets@1", "pets@2"), ("pets@gold", "pets"), (first, "pets")):
        tab.open(f"diff={q(a)}..{q(b)}")
        assert "part-2.parquet" in tab.text("ul.diff-added"), (a, b)

    # ?tab=rows with ?start= and ?row=: a snapshot's samples as rows
    tab.open(f"open={q('pets@gold')}&tab=rows")
    assert _row_indexes(page) == list(range(PAGE_ROWS))
    for ref in v1:
        tab.open(f"snapshot={q(ref)}&row=27")  # row= alone opens the rows tab
        page.wait_for_selector(".rows-table tr[data-index='27'].focus")
        assert _row_indexes(page) == list(range(20, 40)), ref
    tab.open("open=pets&start=40")
    assert _row_indexes(page) == list(range(40, 45))
    page.click("button[data-page='first']")
    page.wait_for_selector(".rows-table tr[data-index='0']")
    assert "tab=rows" in page.url
    assert "open=pets" in page.url

    # ?tab=rl: a dataset of rollouts, by name and by id
    for ref in ("grpo", "grpo@1", grpo):
        tab.open(f"open={q(ref)}&tab=rl")
        assert page.locator(".rl-group").count() == len(ROLLOUT_REWARDS), ref
    tab.open(f"snapshot={q(grpo)}&tab=rl")
    assert page.locator(".rl-group").count() == len(ROLLOUT_REWARDS)
    # ?map=: RL fields under other names
    _write_parquet(
        root / "mapped.parquet",
        {"question": ["q1", "q1"], "answer": ["a", "b"], "score": [0.5, 1.5]},
    )
    tab.open("open=local/mapped.parquet&tab=rl&map=prompt:question,completion:answer,reward:score")
    assert page.locator(".rl-group .rollout").count() == 2
    # ?format=: an object read as another format
    tab.open("open=" + q("local/ds/part-0.parquet") + "&format=binary")
    assert "PAR1" in tab.text("pre.hex")
    # ?view=
    tab.open("view=datasets")
    page.wait_for_selector("a[href$='dataset=pets']")
    tab.open("view=step")
    page.wait_for_selector("form.step-form input[name='ref']")
    tab.assert_clean()


# -- safety ----------------------------------------------------------------------------


def _assert_inert(page: Page) -> None:
    assert page.evaluate("() => window.__pwned") is None
    # the only script is the page's own module; no data became an element
    assert page.evaluate("() => [...document.scripts].map(s => s.src)") == [
        page.url.split("/inspect/")[0] + "/static/inspect.js"
    ]
    assert (
        page.evaluate(
            "() => [...document.images].filter(i => i.getAttribute('src') === 'x').length"
        )
        == 0
    )
    assert (
        page.evaluate(
            "() => [...document.querySelectorAll('[href]')]"
            ".filter(a => /^\\s*javascript:/i.test(a.getAttribute('href'))).length"
        )
        == 0
    )
    assert (
        page.evaluate(
            "() => [...document.querySelectorAll('*')]"
            ".filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length"
        )
        == 0
    )


@pytest.mark.parametrize("name", ["hostile.jsonl", "hostile.parquet"])
def test_hostile_values_render_as_text(tab: Tab, name: str) -> None:
    page = tab.page
    response = tab.open(f"open=local/{name}")
    assert response is not None
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "script-src 'self'" in csp
    assert "'unsafe-inline'" not in csp
    shown = tab.text(".rows-holder")
    for value in HOSTILE.values():
        # a table cell shows the text as it is; a record shows it as JSON does
        assert (value if name.endswith(".parquet") else json.dumps(value)) in shown
    if name.endswith(".jsonl"):
        assert json.dumps(HOSTILE["img"]) + ": " in shown  # a key that is markup, as text
    _assert_inert(page)
    tab.open("sample=" + quote(f"local/{name}#0", safe=""))
    shown = tab.text("section.sample")
    for value in HOSTILE.values():
        assert json.dumps(value) in shown
    _assert_inert(page)
    tab.assert_clean()


def test_the_csp_refuses_an_inline_script(tab: Tab) -> None:
    page = tab.page
    tab.open()
    violated = page.evaluate(
        """() => new Promise(resolve => {
            document.addEventListener('securitypolicyviolation',
                e => resolve(e.violatedDirective), {once: true});
            const s = document.createElement('script');
            s.textContent = 'window.__pwned = 2';
            document.body.append(s);
        })"""
    )
    assert violated.startswith("script-src")
    assert page.evaluate("() => window.__pwned") is None
    assert any("Content Security Policy" in e for e in tab.errors)


# -- screenshots -----------------------------------------------------------------------


_SHOTS = pytest.mark.skipif(
    os.environ.get("CHUNKD_SCREENSHOTS") != "1", reason="CHUNKD_SCREENSHOTS=1 retakes them"
)


@_SHOTS
def test_screenshots_for_the_readme(tab: Tab) -> None:
    """docs/images/inspector-*.png, the views docs/inspector.md shows (1280 by 800)."""
    page = tab.page
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    tab.open("open=local/x.parquet")
    page.wait_for_function(
        "() => [...document.querySelectorAll('img.cell-media')]"
        ".every(i => i.complete && i.naturalWidth > 0)"
    )
    page.screenshot(path=str(DOCS_IMAGES / "inspector-parquet.png"))
    page.click(".rows-table tr[data-index='2'] img.cell-media")
    _loaded_image(page, "#lightbox-img")
    page.screenshot(path=str(DOCS_IMAGES / "inspector-lightbox.png"))
    page.keyboard.press("Escape")
    page.fill("#goto-row", "30")
    page.click(".goto button[type='submit']")
    page.wait_for_selector(".rows-table tr[data-index='30'].focus")
    page.wait_for_function("() => window.scrollY > 0")
    page.wait_for_timeout(200)
    page.screenshot(path=str(DOCS_IMAGES / "inspector-jump.png"))
    tab.open("open=" + quote("local/rl/rollouts.parquet", safe="") + "&tab=rl")
    page.locator(".rl-group").first.wait_for()
    page.screenshot(path=str(DOCS_IMAGES / "inspector-rollouts.png"))
    tab.open("open=" + quote("local/rl/episodes.parquet", safe="") + "&tab=rl")
    page.locator(".episode svg.timeline .tl-step").nth(4).click()
    _loaded_image(page, ".episode .step-detail[data-step='4'] img")
    page.screenshot(path=str(DOCS_IMAGES / "inspector-rl.png"))
    tab.open("open=local/media/tone.flac")
    page.wait_for_function(
        "() => { const a = document.querySelector('audio'); return a && a.readyState >= 1 }"
    )
    page.screenshot(path=str(DOCS_IMAGES / "inspector-audio.png"), clip=_CLIP_TOP)
    tab.assert_clean()


#: the top of the page, where a short view is
_CLIP_TOP = {"x": 0, "y": 0, "width": 1280, "height": 420}


@_SHOTS
def test_screenshot_of_the_landing_page_without_a_local_backend(
    browser: Browser, start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    data = tmp_path / "elsewhere"
    data.mkdir()
    daemon = start_daemon(f'[[backends]]\nname = "data"\nurl = "file://{data}"\n')
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        found = Tab(context.new_page(), daemon)
        found.open()
        found.page.locator(".registry-missing").wait_for()
        found.page.screenshot(path=str(DOCS_IMAGES / "inspector-landing.png"), clip=_CLIP_TOP)
    finally:
        context.close()
