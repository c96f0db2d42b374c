"""The report renders in a real browser: headless Chromium loads report.html, every plot decodes.

The page itself carries no script (it must open anywhere, offline); the test loads a copy with one line
appended that writes each image's decoded size into a data attribute, and reads it back with --dump-dom.
A screenshot of the untouched page is saved in the test's tmp folder, and its path printed.
"""

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser", shutil.which("chromium") or "",
                             shutil.which("google-chrome") or "") if p and Path(p).exists()), None)
PROBE = ("<script>addEventListener('load', () => document.body.dataset.imgs = [...document.images]"
         ".map(i => i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight + ':' + i.alt).join('|'))</script>")


def chromium(*args, timeout=120):
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                               "--disable-component-update", "--disable-sync", "--no-first-run",
                               "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium; .ci/run does)")
def test_report_renders_its_plots_in_headless_chromium(pipeline_run, tmp_path):
    page = pipeline_run / "report/local/report.html"
    html = page.read_text()
    probed = tmp_path / "probe.html"
    probed.write_text(html.replace("</body>", PROBE + "</body>"))
    dom = chromium("--virtual-time-budget=10000", "--dump-dom", probed.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    match = re.search(r'data-imgs="([^"]*)"', dom.stdout)
    assert match, "the page did not finish loading in chromium"
    images = [entry.split(":", 2) for entry in match.group(1).split("|")]
    alts = [alt for _, _, alt in images]
    for wanted in ("Pareto front", "reliability diagram", "latency histogram", "accuracy and ECE vs",
                   "predicted vs measured latency"):
        assert any(wanted in alt for alt in alts), (wanted, alts)
    for complete, size, alt in images:
        width, height = map(int, size.split("x"))
        assert complete == "true" and width > 100 and height > 100, (alt, size)

    shot = tmp_path / "report.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1200,3000", "--hide-scrollbars", page.as_uri())
    assert res.returncode == 0 and shot.read_bytes().startswith(b"\x89PNG"), res.stderr[-2000:]
    assert shot.stat().st_size > 50_000   # a blank page compresses to a few kB
    print(f"report screenshot: {shot}")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium; .ci/run does)")
@pytest.mark.parametrize("width", [375, 320])
def test_report_fits_a_phone_screen_without_scrolling_sideways(pipeline_run, tmp_path, width):
    """The latency table's flex cell kept its content's width, so the whole page scrolled sideways on a phone
    (probe: 421 px of page in 375); wide tables scroll inside themselves instead. Headless Chromium lays out no
    window below 500 px, so the page is loaded in a frame of the phone's width."""
    shutil.copy(pipeline_run / "report/local/report.html", tmp_path / "report.html")
    frame = tmp_path / "phone.html"
    frame.write_text(f"<html><body style='margin:0'><iframe id='f' src='report.html' style='width:{width}px;"
                     "height:3000px;border:0'></iframe><script>f.addEventListener('load', () => {const d = f."
                     "contentDocument.documentElement; document.body.dataset.widths = d.scrollWidth + 'x' + "
                     "d.clientWidth})</script></body></html>")
    dom = chromium("--allow-file-access-from-files", "--virtual-time-budget=10000", "--window-size=500,3000",
                   "--dump-dom", frame.as_uri())
    match = re.search(r'data-widths="(\d+)x(\d+)"', dom.stdout)
    assert match, ("the page did not finish loading in chromium", dom.stderr[-2000:])
    page_width, screen_width = map(int, match.groups())
    assert page_width <= screen_width, f"the page is {page_width} px wide on a {screen_width} px screen"
