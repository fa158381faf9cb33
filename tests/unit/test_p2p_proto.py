from pathlib import Path

import pytest

from geofed.p2p.proto import generate


def test_committed_generated_code_matches_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the gRPC code")
    files = generate.generate(tmp_path)
    assert [f.name for f in files] == list(generate.GENERATED)
    for f in files:
        committed = generate.HERE / f.name
        assert (generate.without_version_stamps(committed.read_text())
                == generate.without_version_stamps(f.read_text())), (
            f"{committed} is stale: run `python -m geofed.p2p.proto.generate` and commit the result")


def test_stamp_blanking_hides_only_the_tool_versions():
    committed = (generate.HERE / "gossip_pb2_grpc.py").read_text()
    bumped = committed.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9", 1)
    assert bumped != committed
    assert generate.without_version_stamps(bumped) == generate.without_version_stamps(committed)
    pb2 = (generate.HERE / "gossip_pb2.py").read_text()
    blank = generate.without_version_stamps(pb2)
    assert "<stamp>" in blank and blank.count("<stamp>") == 2
    edited = pb2.replace("PushHeader", "PushHeaderX")
    assert generate.without_version_stamps(edited) != blank


def test_generated_modules_import_inside_the_package():
    from geofed.p2p.proto import gossip_pb2, gossip_pb2_grpc

    assert gossip_pb2_grpc.geofed_dot_p2p_dot_proto_dot_gossip__pb2 is gossip_pb2
    msg = gossip_pb2.PushMessage(header=gossip_pb2.PushHeader(sender="a", round=3, total_bytes=9))
    again = gossip_pb2.PushMessage.FromString(msg.SerializeToString())
    assert again.WhichOneof("kind") == "header" and again.header.round == 3
    assert Path(gossip_pb2.__file__).parent == generate.HERE
