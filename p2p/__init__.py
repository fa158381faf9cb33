"""geofed.p2p: the gossip data path between regions (see docs/p2p.md).

Submodules are imported on their own (``geofed.p2p.topology`` must stay cheap: the config
loader imports it; ``grpc_transport`` pulls in gRPC).
"""
