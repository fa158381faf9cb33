"""Regenerate gossip_pb2.py and gossip_pb2_grpc.py: ``python -m geofed.p2p.proto.generate``.

The .proto is compiled from a temporary tree ``geofed/p2p/proto/gossip.proto`` so that the
generated gRPC module imports ``from geofed.p2p.proto import gossip_pb2`` (a bare
``import gossip_pb2`` would not resolve inside the package). Needs grpcio-tools (a test extra).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATED = ("gossip_pb2.py", "gossip_pb2_grpc.py")


# The version stamps record which grpcio-tools/protoc wrote the code (and so the oldest
# runtime it accepts); a newer patch release of the tools changes nothing else, so the
# staleness check compares the code with the stamps blanked out.
_STAMPS = (
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = <stamp>"),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: <stamp>"),
    (re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)"
                r"\s*\d+,\s*\d+,\s*\d+,"), r"\1 <stamp>,"),
)


def without_version_stamps(text: str) -> str:
    """The generated code with the tool-version stamps blanked out."""
    for pattern, repl in _STAMPS:
        text = pattern.sub(repl, text)
    return text


def generate(out_dir: Path) -> list[Path]:
    """Compile gossip.proto into out_dir; returns the generated files."""
    from grpc_tools import protoc  # test extra: only needed to regenerate

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        pkg = src / "geofed" / "p2p" / "proto"
        pkg.mkdir(parents=True)
        shutil.copy(HERE / "gossip.proto", pkg / "gossip.proto")
        out = Path(tmp) / "out"
        out.mkdir()
        rc = protoc.main(["protoc", f"-I{src}", f"--python_out={out}", f"--grpc_python_out={out}",
                          "geofed/p2p/proto/gossip.proto"])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        files = []
        for name in GENERATED:
            dst = out_dir / name
            shutil.copy(out / "geofed" / "p2p" / "proto" / name, dst)
            files.append(dst)
        return files


if __name__ == "__main__":
    for f in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f)
