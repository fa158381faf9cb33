"""The bench room: `geofed bench NAME` drivers that run arms side by side and print ratios.

Each module has ``main(argv) -> int``; the CLI imports it lazily (orchestrator/cli.py BENCHES).
"""
