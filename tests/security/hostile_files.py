"""Hostile files for the security tests: FIFOs that must not hang a test, zip bombs built in a
second, and a child process whose memory is capped and measured.

A FIFO blocks ``open`` until a writer comes, so code that opens one hangs; `call_bounded` runs
the code in a thread and, if it is still blocked after a deadline, opens the FIFO's write end
itself (which releases the reader with an immediate EOF) and fails the test: no test ever hangs.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

GIB = 1 << 30


def call_bounded(fn: Callable[[], Any], fifo: Path, timeout_s: float = 10.0) -> BaseException | None:
    """Run fn(); return the exception it raised (None if it returned). Fails the calling test if
    fn was blocked on `fifo` for `timeout_s`, after unblocking it."""
    outcome: dict[str, BaseException | None] = {"error": None}

    def target():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    hung = thread.is_alive()
    if hung:
        try:  # a reader is blocked in open(): a writer's open succeeds, its close is the reader's EOF
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(timeout_s)
    assert not hung, f"blocked on the FIFO {fifo} for {timeout_s} s (released by the test)"
    return outcome["error"]


def deflate_bomb(path: Path, member: str, header_shape: tuple[int, ...], data_bytes: int, *,
                 others: dict[str, bytes] | None = None) -> Path:
    """An .npz whose `member` is an .npy header for float64 `header_shape` followed by
    `data_bytes` zero bytes, deflated: 2 GiB takes ~2 MB and about a second to build (a block
    of zeros ends in a full flush, so its deflate output repeats verbatim)."""
    header = npy_header(header_shape)
    block = 1 << 24
    assert data_bytes % block == 0
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = comp.compress(header) + comp.flush(zlib.Z_FULL_FLUSH)
    zeros = comp.compress(bytes(block)) + comp.flush(zlib.Z_FULL_FLUSH)
    tail = comp.flush()
    body = head + zeros * (data_bytes // block) + tail
    crc = zlib.crc32(header)
    chunk = bytes(block)
    for _ in range(data_bytes // block):
        crc = zlib.crc32(chunk, crc)
    size = len(header) + data_bytes
    with open(path, "wb") as f:
        entries = [(member + ".npy", body, crc, size, zipfile.ZIP_DEFLATED)]
        for name, raw in (others or {}).items():
            entries.append((name + ".npy", raw, zlib.crc32(raw), len(raw), zipfile.ZIP_STORED))
        central = b""
        for name, data, crc_, usize, method in entries:
            assert usize < 0xFFFFFFFF  # no zip64 records needed
            offset = f.tell()
            f.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc_, len(data), usize,
                                len(name), 0) + name.encode() + data)
            central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21, crc_, len(data),
                                   usize, len(name), 0, 0, 0, 0, 0, offset) + name.encode()
        start = f.tell()
        f.write(central)
        f.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), start, 0))
    return path


def npy_header(shape: tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header for a float64 array of `shape` (the data would follow)."""
    text = "{'descr': '<f8', 'fortran_order': False, 'shape': %r, }" % (shape,)
    text += " " * (64 - (10 + len(text) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


def npy_bytes(array) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def child_peak(code: str, *, cwd: Path, memory_cap: int = 6 * GIB, timeout_s: float = 120) -> dict:
    """Run `code` in a fresh Python whose address space is capped at `memory_cap`; it sets
    `result` (a JSON-able dict). Returns it with the child's peak RSS growth over its imports,
    `grew_mb`. What a hostile file makes one process allocate, without risking this one."""
    script = (
        "import json, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({memory_cap}, {memory_cap}))\n"
        "import numpy, torch, geofed.regions.tasks.base\n"
        "geofed.regions.tasks.base.load_builtin_tasks()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "result = {}\n"
        "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) +
        "except BaseException as exc:\n"
        "    result['error'] = type(exc).__name__ + ': ' + str(exc)\n"
        "result['grew_mb'] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024\n"
        "print(json.dumps(result))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
