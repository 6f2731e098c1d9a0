"""A short soak through the real app (bench/soak.py's `run_soak`, its --quick size): 200 requests with
client aborts, disconnects and short deadlines, workers SIGKILLed (up to two) and KV pulls failing on purpose;
every request ends in a final event, and every worker ends idle with no block held and no lease left.
The full run (2,000 requests) and its figures: bench/RESULTS.md."""
from __future__ import annotations

import asyncio
import json

import pytest

from bench.soak import SoakOptions, cluster_config, quick, run_soak
from bench.soak_report import summary
from cluster.controller import get_controller
from tests.cluster_load import serve_tandem

pytestmark = pytest.mark.slow


def test_a_short_soak_with_kills_and_faults_loses_no_request_and_leaks_nothing(ray_cluster, tiny_llama_dir):
    config = cluster_config(tiny_llama_dir, name="soak", namespace="tandem-tests")
    with serve_tandem(config) as url:
        result = asyncio.run(run_soak(url, get_controller(config.name, config.namespace),
                                      quick(SoakOptions(seed=1))))
    print(summary(result))
    details = json.dumps({k: result[k] for k in ("lost_examples", "workers_at_end", "kills")}, indent=1)
    assert result["requests"] == 200
    assert result["kills"]
    assert result["lost"] == 0, details
    assert result["idle"], details
    assert result["leaked_blocks"] == 0, details
    assert result["leaked_leases"] == 0, details
    assert result["stuck_in_flight"] == 0, details
    assert result["wrong_length"] == 0
    assert sum(result["faults_injected"].values()) > 0
