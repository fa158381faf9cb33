"""Checks that a written report is whole: every PNG is a real image with something drawn on it,
and the page points only at files that exist next to it (nothing on the network). Used by the
tests, and usable by anyone who wants to assert a report in their own (`geofed run`'s, the benches')."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "srcset", "poster", "data") and value:
                self.refs.append(value)


def html_refs(html: str) -> list[str]:
    p = _Refs()
    p.feed(html)
    return p.refs


def png_problems(path: Path, *, min_size: int = 64) -> list[str]:
    """Empty when `path` is a PNG of at least min_size x min_size with something drawn on it:
    a figure that drew nothing is one flat colour, and fails this."""
    from PIL import Image, UnidentifiedImageError  # Pillow comes with matplotlib

    try:
        with Image.open(path) as img:
            if img.format != "PNG":
                return [f"{path.name}: a {img.format} image, not a PNG"]
            rgb = img.convert("RGB")
    except (OSError, UnidentifiedImageError, SyntaxError) as exc:
        return [f"{path.name}: not a readable PNG ({exc})"]
    width, height = rgb.size
    if width < min_size or height < min_size:
        return [f"{path.name}: only {width}x{height} pixels"]
    problem = blank_problem(rgb)
    return [f"{path.name}: {problem}"] if problem else []


def blank_problem(rgb, *, min_colours: int = 8, min_ink: float = 0.005) -> str | None:
    """Why an RGB image looks blank, or None: fewer than `min_colours` colours, or less than
    `min_ink` of its pixels differ from the most common one (the background)."""
    colours = rgb.getcolors(maxcolors=1 << 16)
    n_pixels = rgb.size[0] * rgb.size[1]
    if colours is None:  # more than 65536 colours: certainly not blank
        return None
    background = max(colours)[0]
    if len(colours) < min_colours:
        return f"blank ({len(colours)} colours)"
    if 1 - background / n_pixels < min_ink:
        return f"blank ({(1 - background / n_pixels):.2%} of pixels differ from the background)"
    return None


def report_problems(html_path: str | Path) -> list[str]:
    """Everything wrong with a written report.html and its PNGs; empty when it is whole."""
    html_path = Path(html_path)
    if not html_path.is_file():
        return [f"{html_path}: missing"]
    text = html_path.read_text(encoding="utf-8")
    problems = []
    for ref in html_refs(text):
        parts = urlsplit(ref)
        if parts.scheme or parts.netloc:
            problems.append(f"references {ref!r}: a report must not need the network (or another folder)")
            continue
        if not parts.path:  # a same-page anchor (#id)
            continue
        target = (html_path.parent / unquote(parts.path)).resolve()
        if html_path.parent.resolve() not in target.parents:
            problems.append(f"references {ref!r} outside the report folder")
        elif not target.is_file():
            problems.append(f"references {ref!r}, which does not exist")
        elif target.suffix.lower() == ".png":
            problems += png_problems(target)
    for m in re.finditer(r"url\(\s*['\"]?([^'\")\s]+)", text):
        if urlsplit(m.group(1)).scheme not in ("", "data"):
            problems.append(f"CSS references {m.group(1)!r}: a report must not need the network")
    if "<img" not in text:
        problems.append("shows no image")
    return problems
