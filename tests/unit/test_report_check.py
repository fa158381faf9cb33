"""The report checker must catch what it claims to: a check that passes everything proves nothing."""

from __future__ import annotations

from support.report_check import png_problems, report_problems
from PIL import Image


def _page(tmp_path, body):
    (tmp_path / "report.html").write_text(f"<html><body>{body}</body></html>")
    return tmp_path / "report.html"


def _drawn_png(path):
    img = Image.new("RGB", (200, 120), "white")
    for x in range(20, 180):
        img.putpixel((x, 60 + (x % 40) // 2), (x, 80, 255 - x))
    img.save(path)


def test_a_whole_page_passes(tmp_path):
    _drawn_png(tmp_path / "a.png")
    assert report_problems(_page(tmp_path, '<a href="a.png"><img src="a.png"></a><a href="#x">x</a>')) == []


def test_missing_remote_and_escaping_references_are_caught(tmp_path):
    _drawn_png(tmp_path / "a.png")
    problems = report_problems(_page(tmp_path, '<img src="a.png"><img src="gone.png">'
                                     '<script src="https://cdn.example/x.js"></script><img src="../up.png">'
                                     '<div style="background:url(http://x/y.png)"></div>'))
    text = "\n".join(problems)
    assert "'gone.png', which does not exist" in text
    assert "https://cdn.example/x.js" in text
    assert "outside the report folder" in text
    assert "CSS references 'http://x/y.png'" in text


def test_blank_tiny_and_fake_pngs_are_caught(tmp_path):
    Image.new("RGB", (300, 200), "white").save(tmp_path / "blank.png")
    Image.new("RGB", (10, 10), "red").save(tmp_path / "tiny.png")
    Image.new("RGB", (100, 100), "white").save(tmp_path / "photo.png", format="JPEG")
    (tmp_path / "junk.png").write_bytes(b"not an image")
    assert "blank" in png_problems(tmp_path / "blank.png")[0]
    assert "10x10" in png_problems(tmp_path / "tiny.png")[0]
    assert "not a PNG" in png_problems(tmp_path / "photo.png")[0]
    assert "not a readable PNG" in png_problems(tmp_path / "junk.png")[0]
    assert report_problems(_page(tmp_path, "<p>no pictures</p>")) == ["shows no image"]
