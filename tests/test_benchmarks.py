import json

import numpy as np

from benchmarks.matmul_ceiling import main as ceiling_main
from benchmarks.matmul_ceiling import step_products
from benchmarks.train_throughput import training_flops
from keras_transformer import TransformerConfig


def test_the_step_products_add_up_to_the_analytic_flop_count():
    # Every product of the list, forward and backward, on a batch without
    # padding must give exactly the benchmark's analytic count (3 x forward).
    config = TransformerConfig.from_preset("paper-base", vocabulary_size=37000)
    for batch_size, source_len, target_len in ((3, 7, 5), (40, 20, 20)):
        products = step_products(config, batch_size, source_len, target_len)
        total = sum(2.0 * p["count"] * p["batch"] * p["m"] * p["k"] * p["n"] for p in products)
        expected = training_flops(
            config, np.full(batch_size, source_len), np.full(batch_size, target_len)
        )
        assert total == expected
        # Each backward pair costs what its forward product does.
        forward = sum(
            2.0 * p["count"] * p["batch"] * p["m"] * p["k"] * p["n"]
            for p in products
            if p["name"].endswith("forward")
        )
        assert total == 3 * forward


def test_ceiling_benchmark_runs_and_writes_json(tmp_path):
    out = tmp_path / "ceiling.json"
    summary = ceiling_main(
        [
            "--shape",
            "small",
            "--budget",
            "128",
            "--repeats",
            "1",
            "--rounds",
            "2",
            "--out",
            str(out),
        ]
    )
    written = json.loads(out.read_text())
    assert written["summary"] == summary
    assert written["shape"] == "small" and written["tokens_per_batch"] == 128
    # Padding only adds FLOPs, so the padded products carry at least the model's.
    assert summary["padded_matmul_tflop"] >= summary["model_tflop"] > 0
    assert summary["matmul_seconds"] > 0 and all(p > 0 for p in summary["peaks_measured_gflops"])
    assert 0 < summary["mfu_ceiling"] < 1.5
    assert {p["name"] for p in written["products"]} >= {"output dE", "encoder ffn in dW"}
    # Two rounds: every product timed twice, keeping the best; peaks at the
    # start and after each round.
    for product in written["products"]:
        assert len(product["seconds_by_round"]) == 2
        assert product["seconds"] == min(product["seconds_by_round"])
    assert len(summary["peaks_measured_gflops"]) == 3


def test_ablations_run_and_agree():
    from benchmarks.ablations import main as ablations_main

    # Each experiment checks that its variants compute the same thing before timing.
    results = ablations_main(
        ["column-sum", "qkv", "xla-matmul", "loss", "dropout", "--rows", "200", "--rounds", "1"]
    )
    assert set(results) == {"column-sum", "qkv", "xla-matmul", "loss", "dropout"}
    assert set(results["loss"]) == {"logsumexp, exp again (ours)", "softmax kept"}
    assert set(results["qkv"]) == {"separate", "fused, split", "fused, sliced"}
    assert all(s > 0 for medians in results.values() for s in medians.values())
