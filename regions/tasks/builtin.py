"""Importing this module registers the built-in tasks."""

from . import charlm, digits, gpt, hf  # noqa: F401
from . import graph  # noqa: F401
