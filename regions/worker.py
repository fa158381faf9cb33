"""Moved to regions/messages.py (RoundPlan, rss_mb). This re-export stays only until the importers
that other open edits hold (regions/region.py, actor.py, hooks.py, sync/diloco.py, sync/protocol.py,
the driver's run.py, a few tests) are committed with their import of regions/messages.py; then it goes.
"""

from .messages import RoundPlan, rss_mb

__all__ = ["RoundPlan", "rss_mb"]
