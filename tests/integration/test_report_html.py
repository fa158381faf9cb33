"""report.html opened in headless Chromium: the page renders and its screenshot is not blank.

Chromium comes from Debian's `chromium` package (.ci/install-chromium); where it is missing the
test skips and says so. `chromium_screenshot` is also used by test_report_run.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_report_fakerun import fake_run_dir  # noqa: E402  (test data, shared with the unit tests)

from geofed.orchestrator.report import write_report  # noqa: E402
from geofed.orchestrator.report.check import blank_problem, report_problems  # noqa: E402

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


def coloured_fraction(png: Path) -> float:
    """Share of pixels with a clear hue: the page's text, tables and background are grey, so
    this counts the plots (curves, heatmap, shading) and tells a page with them from one without."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as img:
        a = np.asarray(img.convert("RGB")).astype(int)
    return float(((a.max(axis=2) - a.min(axis=2)) > 40).mean())


def assert_screenshot_not_blank(png: Path) -> None:
    from PIL import Image

    with Image.open(png) as img:
        problem = blank_problem(img.convert("RGB"), min_colours=50, min_ink=0.03)
    assert problem is None, f"screenshot {png}: {problem}"
    assert coloured_fraction(png) > 0.01, f"screenshot {png}: no plots visible (only {coloured_fraction(png):.2%} coloured pixels)"


def test_chromium_renders_the_report(tmp_path):
    run = fake_run_dir(tmp_path / "run", rounds=5)
    html = write_report(run)
    assert report_problems(html) == []
    shot = tmp_path / "shot.png"
    chromium_screenshot(html, shot)
    assert_screenshot_not_blank(shot)


def test_the_screenshot_check_sees_missing_plots(tmp_path):
    """The same page with its PNGs deleted must fail the check above, or the check proves nothing."""
    html = write_report(fake_run_dir(tmp_path / "run", rounds=5))
    for png in html.parent.glob("*.png"):
        png.unlink()
    shot = tmp_path / "shot.png"
    chromium_screenshot(html, shot)
    with pytest.raises(AssertionError, match="no plots visible"):
        assert_screenshot_not_blank(shot)
