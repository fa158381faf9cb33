"""The bench room (`geofed.bench`, distribution geofed-bench, not in geofed's wheel): `geofed bench NAME`
drivers that run arms side by side and print ratios, and the helpers only they use (the hostile peer,
the kernel hub, the local multi-node cluster, the link measuring core).

It sits above orchestrator: it imports the four rooms, none of them imports it (tests/unit/test_layering.py).
Each bench module has ``main(argv) -> int``; cli.py's BENCHES names them.
"""
