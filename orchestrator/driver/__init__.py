"""The driver room: one run from config to summary.

The runner places the region actors, drives the rounds, asks the coordinator for H and codecs,
notices failed and stalled regions, checkpoints, resumes, and writes the run directory.
"""
