"""report.html opened in headless Chromium: every plot decodes, and the screenshot is not blank.

Chromium comes from Debian's `chromium` package (.ci/install-chromium); where it is missing the
tests skip and say so. `assert_plots_rendered` is also used by test_report_run.py.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from geofed.orchestrator.report import write_report
from support.report_check import blank_problem, report_problems
from test_report_fakerun import fake_run_dir

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--disable-extensions", "--mute-audio")


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def chromium_screenshot(html: Path, png: Path, *, width: int = 1280, height: int = 2400, timeout: float = 60) -> None:
    """Screenshot file://html into png; skips the calling test when Chromium is not installed."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("Chromium is not installed (Debian package `chromium`; .ci/install-chromium installs it)")
    with tempfile.TemporaryDirectory(prefix="geofed-chromium-") as profile:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
               f"--window-size={width},{height}", html.resolve().as_uri()]
        # Its own process group, so a hung Chromium is killed with all its helpers and nothing else.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            pytest.fail(f"Chromium did not finish a screenshot within {timeout:.0f}s")
    if proc.returncode != 0 or not png.is_file():
        tail = out.decode(errors="replace")[-2000:]
        pytest.fail(f"Chromium exited {proc.returncode} without a screenshot:\n{tail}")


def assert_screenshot_not_blank(png: Path) -> None:
    from PIL import Image

    with Image.open(png) as img:
        problem = blank_problem(img.convert("RGB"), min_colours=50, min_ink=0.03)
    assert problem is None, f"screenshot {png}: {problem}"


PROBE = ("<script>window.addEventListener('load', () => document.body.setAttribute('data-widths', "
         "Array.from(document.images).map(i => i.naturalWidth).join(',')))</script>")


def chromium_image_widths(html: Path, timeout: float = 60) -> list[int]:
    """The naturalWidth Chromium decoded for each <img> of the page, in order (0: not loaded).
    A copy of the page with a one-line probe script is loaded with --dump-dom; the report
    itself has no script."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("Chromium is not installed (Debian package `chromium`; .ci/install-chromium installs it)")
    probe = html.parent / "_probe.html"
    probe.write_text(html.read_text().replace("</body>", PROBE + "</body>"))
    try:
        with tempfile.TemporaryDirectory(prefix="geofed-chromium-") as profile:
            proc = subprocess.Popen([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", probe.resolve().as_uri()],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
            try:
                dom, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                pytest.fail(f"Chromium did not dump the page within {timeout:.0f}s")
    finally:
        probe.unlink()
    m = re.search(r'data-widths="([0-9,]*)"', dom.decode(errors="replace"))
    assert m is not None, "the probe did not run: Chromium never fired the page's load event"
    return [int(w) for w in m.group(1).split(",") if w]


def assert_plots_rendered(html: Path, tmp: Path) -> None:
    """Every plot decoded in Chromium, and the page's screenshot is not blank."""
    n_imgs = html.read_text().count("<img")
    shot = tmp / "screenshot.png"
    # The two Chromium launches (each a browser start, seconds) run at once, each with its own profile.
    with ThreadPoolExecutor(max_workers=1) as pool:
        screenshot = pool.submit(chromium_screenshot, html, shot)
        widths = chromium_image_widths(html)
        assert len(widths) == n_imgs > 0, (widths, n_imgs)
        assert all(w > 100 for w in widths), f"images Chromium could not show (width 0): {widths}"
        screenshot.result()
    assert_screenshot_not_blank(shot)


@pytest.fixture(scope="module")
def rendered_run(tmp_path_factory) -> tuple[Path, Path]:
    """One fake run and its report.html, written once: both tests below read it (the second a copy)."""
    run = fake_run_dir(tmp_path_factory.mktemp("report") / "run", rounds=5)
    return run, write_report(run)


def test_chromium_renders_the_report(rendered_run, tmp_path):
    _, html = rendered_run
    assert report_problems(html) == []
    assert_plots_rendered(html, tmp_path)


def test_the_screenshot_check_sees_missing_plots(rendered_run, tmp_path):
    """The same page with its PNGs deleted must fail the check above, or the check proves nothing."""
    run, written = rendered_run
    shutil.copytree(run, tmp_path / "run")
    html = tmp_path / "run" / written.relative_to(run)
    for png in html.parent.glob("*.png"):
        png.unlink()
    with pytest.raises(AssertionError, match="could not show"):
        assert_plots_rendered(html, tmp_path)
