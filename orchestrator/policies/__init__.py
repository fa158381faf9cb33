"""Sync policies: pure functions (measurements, state) -> (H, codec per link)."""
