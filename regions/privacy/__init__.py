"""geofed.regions.privacy: differential privacy for a region's training (docs/privacy.md).

``dp``: per-example clipping and noise (record level) and the clip and noise of a pseudo-gradient
(update level); ``accountant``: the RDP accountant that turns them into epsilon for a delta.
"""
