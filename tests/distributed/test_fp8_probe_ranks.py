"""FP8Probe under ETTStrategy on 2 real gloo ranks: each rank samples its own data, one all-gather combines them."""

from __future__ import annotations

import json
import math

from conftest import SCRIPTS, launch
from scipy import stats

from lightning_ett import summarize_run_dir


def test_rank_combined_verdicts_equal_those_of_the_pooled_samples(tmp_path):
    proc = launch(str(SCRIPTS / "fp8_job.py"), "dlrm", "--devices", "2", "--steps", "60", "--out", str(tmp_path),
                  "--run-dir", str(tmp_path / "run"), run_dir=tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["results"] == ranks[1]["results"]  # every rank holds the combined verdict
    results = ranks[0]["results"]
    # The DLRM's dense MLPs are probed; its (sharded) embedding tables are not Linear layers.
    assert sorted(results) == ["model.dense_arch.model._mlp.0._linear", "model.dense_arch.model._mlp.1._linear",
                               "model.over_arch.model.0._mlp.0._linear", "model.over_arch.model.0._mlp.1._linear",
                               "model.over_arch.model.1"]
    threshold, confidence = ranks[0]["threshold"], ranks[0]["confidence"]
    for fqn, result in results.items():
        pooled = ranks[0]["samples"][fqn] + ranks[1]["samples"][fqn]  # each rank's raw samples, pooled by hand
        assert all(len(r["samples"][fqn]) >= 1 for r in ranks) and result["samples"] == len(pooled)
        n = len(pooled)
        mean = sum(pooled) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in pooled) / (n - 1))
        half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
        assert math.isclose(result["sqnr_db_mean"], mean, rel_tol=1e-9)
        assert math.isclose(result["sqnr_db_low"], mean - half, rel_tol=1e-9)
        assert math.isclose(result["sqnr_db_high"], mean + half, rel_tol=1e-9)
        expected = "safe" if mean - half >= threshold else "unsafe" if mean + half < threshold else "undecided"
        assert result["verdict"] == expected, (fqn, result)
    assert all(r["verdict"] == "safe" for r in results.values())  # ordinary MLPs over well-scaled activations
    assert not any(r["eligible"] for r in results.values())  # all far below torchao's FP8 sizes
    (fact,) = summarize_run_dir(tmp_path / "run").facts_named("fp8_probe")  # rank 0 states it once
    assert fact["layers"] == 5 and fact["safe_and_eligible"] == 0
