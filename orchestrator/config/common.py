"""What every config section module shares: the field-doc helper and the name pattern."""

from __future__ import annotations

import re

# fullmatch: `$` alone also matches before a trailing newline ("x\n" would pass).
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def _doc(text: str, **kw) -> dict:
    return {"doc": text, **kw}
