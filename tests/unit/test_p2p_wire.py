"""The hand-rolled Push message path must equal protobuf's encoding and never raise on garbage."""

from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.p2p.proto import gossip_pb2
from geofed.p2p.service import encode_chunk, parse_push_message


@given(st.binary(max_size=3000))
def test_encode_chunk_is_what_protobuf_emits_and_parses_back(data):
    raw = encode_chunk(memoryview(data))
    assert raw == gossip_pb2.PushMessage(chunk=data).SerializeToString()
    kind, view = parse_push_message(raw)
    assert kind == "chunk" and bytes(view) == data


def test_large_chunk_and_header_round_trip():
    data = bytes(range(256)) * 4096  # 1 MiB: a 3-byte varint length
    assert encode_chunk(memoryview(data)) == gossip_pb2.PushMessage(chunk=data).SerializeToString()
    raw = gossip_pb2.PushMessage(header=gossip_pb2.PushHeader(sender="r1", round=7, total_bytes=1 << 40)).SerializeToString()
    kind, h = parse_push_message(raw)
    assert kind == "header" and (h.sender, h.round, h.total_bytes) == ("r1", 7, 1 << 40)


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_parse_never_raises_on_garbage(raw):
    kind, _ = parse_push_message(raw)
    assert kind in ("header", "chunk", "malformed")


def test_malformed_messages_say_why():
    assert parse_push_message(b"") == ("malformed", "message without a complete field header")
    assert parse_push_message(b"\x12\x05abc")[0] == "malformed"  # length overruns the message
    assert parse_push_message(b"\x1a\x01a") == ("malformed", "unexpected field tag 0x1a")
    assert parse_push_message(b"\x0a\x02\xff\xff")[0] == "malformed"  # undecodable header
