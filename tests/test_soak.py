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
    """With a second tenant flooding beside the soak's (its own key, max_queued 4, an ingress queue of 16
    placed requests): the flood's excess is refused with 429, the soak tenant never is, and flow control
    ends with nothing queued or running."""
    options = quick(SoakOptions(seed=1, flood_requests=100, flood_concurrency=24))
    config = cluster_config(tiny_llama_dir, name="soak", namespace="tandem-tests",
                            flood_max_in_flight=options.flood_max_in_flight)
    with serve_tandem(config) as url:
        result = asyncio.run(run_soak(url, get_controller(config.name, config.namespace), options))
    print(summary(result))
    details = json.dumps({k: result[k] for k in ("lost_examples", "workers_at_end", "kills")}, indent=1)
    assert result["requests"] == 300
    assert "http_429" not in result["by_tenant"]["soak"], result["by_tenant"]
    assert result["by_tenant"]["flood"].get("http_429"), result["by_tenant"]
    assert result["flow_at_end"] == {"queued": 0, "running": 0}, result["flow_at_end"]
    assert result["kills"]
    assert result["lost"] == 0, details
    assert result["idle"], details
    assert result["leaked_blocks"] == 0, details
    assert result["leaked_leases"] == 0, details
    assert result["stuck_in_flight"] == 0, details
    assert result["wrong_length"] == 0
    assert sum(result["faults_injected"].values()) > 0
