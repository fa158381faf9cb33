"""Importing this module registers the built-in tasks."""

from . import digits  # noqa: F401
