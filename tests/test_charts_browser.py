"""Every chart kind, and the report, opened in headless Chromium (Debian's `chromium`, which
.ci/run installs): no JavaScript errors, every plot drawn with data, titles and axis titles
shown; on the what-if page a slider dragged with the mouse changes the shown value, the best
plan's numbers, and puts the other sliders back to 1x; and a screenshot that is not blank.
Driven by tests/browser.py (`--dump-dom` with injected scripts; no DevTools client needed)."""

from __future__ import annotations

import os
import struct
import zlib

import pytest

from browser import CHROMIUM, check_pages, screenshot
from ledger_sample import synthetic_ledger
from perfsim import cli
from perfsim.spec.system import load_system

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium; "
                                                         ".ci/run installs it, so CI runs these tests)")

CASE = ["--model", "smng-p2-20b", "--system", "smng-p2", "--nodes", "2", "--gbs", "16", "--tp", "4", "--pp", "4",
        "--fix", "order=tp-dp-pp", "--fix", "zero=0", "--top", "3", "--node-counts", "2,4,8",
        "--uncertainty", "--samples", "32"]  # bands, error bars, the what-if's spread; the report's section
KINDS = ("whatif", "heatmap", "scaling", "memory", "breakdown", "timeline", "validation")


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pages")
    ledger = folder / "ledger.jsonl"
    synthetic_ledger(ledger, load_system("smng-p2"))
    written = {}
    for kind in KINDS:
        out = folder / f"{kind}.html"
        argv = ["chart", kind, "--system", "smng-p2", "--ledger", str(ledger)] if kind == "validation" else \
            ["chart", kind, *CASE]
        assert cli.main(argv + ["--out", str(out)]) == 0
        written[kind] = str(out)
    out = folder / "report.html"
    assert cli.main(["report", *CASE, "--ledger", str(ledger), "--out", str(out)]) == 0
    written["report"] = str(out)
    out = folder / "timeline-deep.html"  # 44 stages: a page taller than the screen
    deep = ["--model", "smng-p2-20b", "--system", "smng-p2", "--devices", "44", "--gbs", "16", "--pp", "44"]
    assert cli.main(["chart", "timeline", *deep, "--out", str(out)]) == 0
    written["timeline-deep"] = str(out)
    found = check_pages(list(written.values()), str(folder))
    return written, {kind: found[path] for kind, path in written.items()}, folder


@pytest.mark.parametrize("kind", KINDS + ("report",))
def test_page_draws_its_plots_without_errors(kind, pages):
    _, found, _ = pages
    result = found[kind]
    assert result is not None, "the page's check script never reported (the page did not finish loading)"
    assert result["errors"] == [], result["errors"]
    assert result["plotly"], "plotly.js did not load from the page itself"
    plots = result["plots"]
    assert len(plots) == (8 if kind == "report" else 1)
    for plot in plots:
        assert plot["traces"] > 0 and plot["points"] > 0, plot
        assert plot["marks"] > 0, f"nothing drawn in the SVG: {plot}"
        assert plot["title"] and len(plot["title"]) > 20
        assert sum(1 for a in plot["axes"] if a.get("title")) >= 2, plot["axes"]
        assert plot["width"] > 300 and plot["height"] > 300


def test_whatif_slider_moves_the_shown_values(pages):
    _, found, _ = pages
    slider = found["whatif"]["slider"]
    assert slider is not None, "no slider found on the what-if page"
    before, (first, second) = slider["before"], slider["moves"]
    assert before["current"][0].endswith(": 1x") and all(a == before["active"][0] for a in before["active"])
    # the first slider (device FLOP/s) dragged to 3x: its label, the plan box and the data change
    assert first["label"] == "3x"
    assert first["after"]["current"][0].endswith(": 3x")
    # (a plan's own "interleaved x3" may be in both: the multiplier's words are what moved)
    assert "x3, the rest 1x" in first["after"]["notes"] and "x3, the rest" not in before["notes"]
    assert first["after"]["data"] != before["data"]
    assert first["after"]["active"][0] == first["step"]
    # the second slider moved: it shows its value and the first goes back to 1x
    assert second["after"]["current"][1].endswith(": 0.5x")
    assert second["after"]["current"][0].endswith(": 1x")
    assert second["after"]["active"][0] == before["active"][0]
    assert "x0.5, the rest 1x" in second["after"]["notes"]
    assert slider["events"] == ["sliderchange 3x", "update", "sliderchange 0.5x", "update"]


def _png_ink(path: str) -> tuple:
    """(width, height, share of pixels that are not white) of an 8-bit RGB/RGBA PNG."""
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, colour = header[:4]
    assert depth == 8 and colour in (2, 6)
    channels = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    previous = bytearray(stride)
    ink = 0
    for row in range(height):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):  # undo the PNG filters
            a = line[i - channels] if i >= channels else 0
            b = previous[i]
            c = previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if row % 4 == 0:
            ink += sum(1 for i in range(0, stride, channels * 4) if min(line[i:i + 3]) < 200)
        previous = line
    return width, height, ink / (height / 4 * width / 4)


def test_screenshot_of_the_whatif_page_shows_a_chart(pages):
    written, _, folder = pages
    png = os.path.join(folder, "whatif.png")
    screenshot(written["whatif"], png, str(folder), size=(1200, 900))
    assert os.path.getsize(png) > 30_000
    width, height, ink = _png_ink(png)
    assert (width, height) == (1200, 900)
    assert 0.03 < ink < 0.6, f"{ink:.1%} of the screenshot is drawn on"


def _overlap(a: dict, b: dict) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


@pytest.mark.parametrize("kind", KINDS + ("report",))
def test_titles_are_inside_their_plot_and_clear_of_each_other(kind, pages):
    """A rotated axis title longer than its plot is cut off at the plot's edge and runs into the
    chart's title (the report's plan-bar charts did): every axis title lies within its plot and
    overlaps neither the chart title nor another axis title."""
    _, found, _ = pages
    for plot in found[kind]["plots"]:
        b = plot["boxes"]
        area, titles = b["plot"], {(t["text"], t["left"], t["top"]): t for t in b["axisTitles"] if t["text"]}.values()
        assert titles, plot["id"]
        for t in titles:
            assert area["left"] - 1 <= t["left"] and t["right"] <= area["right"] + 1, (plot["id"], t, area)
            assert area["top"] - 1 <= t["top"] and t["bottom"] <= area["bottom"] + 1, (plot["id"], t, area)
            assert b["title"] is None or not _overlap(t, b["title"]), (plot["id"], t, b["title"])
            assert not any(_overlap(t, u) for u in titles if u is not t), (plot["id"], t)


def test_timeline_time_axis_is_on_the_first_screen(pages):
    """A tall timeline (many stages) must show its time axis without scrolling: 900 px down."""
    _, found, _ = pages
    plot = found["timeline-deep"]["plots"][0]
    assert plot["height"] > 1100  # taller than the window
    ticks = plot["boxes"]["xticks"]
    assert ticks and min(t["top"] for t in ticks) < 900, ticks[:3]
