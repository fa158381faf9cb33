"""The README is for users: it speaks of what geofed does, not of the project's issue tracker.

Before this test it said "issue 17 asks for 3%", "issue 21's targets" and "every target of issue 22",
which tell a reader nothing; each is now the goal itself.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_names_no_issue_numbers_or_finding_codes():
    text = README.read_text(encoding="utf-8")
    hits = [m.group(0) for m in re.finditer(r"(?i)\bissues?\s*#?\d+|\bfindings?\s+N\d+|\bN\d{1,2}\b(?=[:,)])", text)]
    assert hits == [], f"README.md uses tracker jargon a user cannot follow: {hits}"
