"""benchmarks/serve_load.py runs end to end on a tiny export with tiny settings (so it does not rot)."""

import json

import pytest

from benchmarks.serve_load import main

pytestmark = pytest.mark.integration


def test_the_load_benchmark_measures_every_system_and_the_soak(tiny_export, tmp_path):
    export, _ = tiny_export
    source = tmp_path / "source.txt"
    source.write_text("".join(f"ka ko li {i}\n" for i in range(12)))
    out = tmp_path / "serve_load.json"
    report = main(
        ["--onnx", export, "--source", str(source), "--clients", "1,4", "--beams", "1"]
        + ["--soak", "1", "--soak-clients", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    systems = [(row["system"], row["clients"]) for row in report["rows"]]
    assert systems == [
        ("offline batch 32", None),
        ("offline batch 32, in order", None),
        ("batching", 1),
        ("batching", 4),
        ("no-batching", 1),
        ("no-batching", 4),
    ]
    for row in report["rows"]:
        assert row["sentences"] == 12 and row["sentences_per_s"] > 0
        assert row.get("errors", 0) == 0
    assert set(report["ratios"]) == {"beam 1, 1 clients", "beam 1, 4 clients"}
    soak = report["soak"]
    assert soak["requests"] > 0 and set(soak["statuses"]) == {"200"}
    assert soak["sigterm"]["exit_status"] == 0
    assert soak["sigterm"]["unanswered_after_sigterm"] == 0
