"""The driver room: one run from config to summary.

setup.py places the region actors and hands over what the round loop needs; run.py holds the
loop (coordinator -> regions -> observe -> log -> checkpoint); handles.py is the typed handle it
calls the regions through; faults.py, pacing.py and privacy.py are the objects passed into it.
"""
