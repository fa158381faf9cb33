"""The launch room: `geofed launch` turns a config's ``launch:`` section into a placement plan,
renders Ray cluster files from it, and starts a local cluster for trying it out.
"""
