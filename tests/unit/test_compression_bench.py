"""`geofed bench codecs` on small sizes: the JSON document's shape, the table, the targets."""

from __future__ import annotations

import json

from geofed.compression import codec_names
from geofed.bench import codecs as bench


def test_json_document_has_every_codec_both_references_and_the_targets(capsys):
    assert bench.main(["--numel", "100000", "3001", "--repeat", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["kind"] for r in doc["results"]} == set(codec_names())
    assert {(r["numel"]) for r in doc["results"]} == {100000, 3001}
    for r in doc["results"]:
        assert {"codec", "numel", "ratio", "encode_mb_s", "decode_mb_s", "rel_error"} <= set(r)
        assert r["ratio"] > 0 and r["encode_mb_s"] > 0 and r["decode_mb_s"] > 0 and r["rel_error"] >= 0
    refs = {(r["name"], r["numel"]) for r in doc["reference"]}
    assert refs == {(name, n) for name in ("bf16-into-buffer", "int8-per-tensor") for n in (100000, 3001)}
    by = {(r["codec"], r["numel"]): r for r in doc["results"]}
    assert by[("identity", 100000)]["rel_error"] == 0.0
    assert by[("int8", 100000)]["ratio"] > 3.9
    assert by[("topk(fraction=0.01,inner=int8)", 100000)]["ratio"] > by[("topk", 100000)]["ratio"] > 60
    # ratio targets hold at any size; speed targets are only judged at 25M floats
    targets = doc["targets"]
    ratio_targets = [t for t in targets if "ratio" in t["target"] and t["numel"] == 100000]
    assert len(ratio_targets) >= 5 and all(t["pass"] and t["applies"] for t in ratio_targets)
    assert all(not t["applies"] for t in targets if "MB/s" in t["target"])


def test_table_and_bad_arguments(capsys):
    assert bench.main(["--numel", "20000", "--repeat", "1", "--codec", "int8", '{"kind": "topk", "fraction": 0.05}',
                       "topk(fraction=0.1,inner=int8)"]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and "targets" in out and "bf16-into-buffer" in out
    # Table cells are cut to the column; the keys start alike.
    assert "topk(fraction=0.05" in out and "topk(fraction=0.1," in out
    assert bench.main(["--codec", "zstd"]) == 2
    assert "kind: unknown codec 'zstd'" in capsys.readouterr().out
    assert bench.main(["--numel", "0"]) == 2


def test_cli_dispatches_to_the_bench(capsys):
    from geofed.orchestrator.cli import main

    assert main(["bench", "codecs", "--numel", "5000", "--repeat", "1", "--codec", "fp16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["codec"] for r in doc["results"]] == ["fp16"]
