"""`transfer.tls` in the cluster config reaches real workers: prefill workers' KV servers serve TLS only and
decode workers pull over it, so remote prefills move their KV with no fallback; bad files stop the config."""
import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from tests.pool_helpers import only, run_all
from tests.test_kv_transfer_tls import make_ca


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_ca(tmp_path_factory.mktemp("pki"), "cluster")


def tls_options(files: dict[str, str], **options) -> dict:
    # The certificate names localhost: the workers dial their node's IP, whatever Ray reports it to be.
    return {"cert_file": files["cert"], "key_file": files["key"], "ca_file": files["ca"], "server_name": "localhost",
            **options}


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_llama_dir, tls_files):
    config = ClusterConfig(model=tiny_llama_dir, name="tls", engine={"num_kv_blocks": 96, "max_num_batched_tokens": 64},
                           prefill={"resources": {"prefill_pool": 1}, "num_cpus": 0.5},
                           decode={"resources": {"decode_pool": 1}, "num_cpus": 0.5},
                           transfer={"tls": tls_options(tls_files, mutual=True)})
    pools = Pools(config)
    pools.start()
    yield pools
    pools.shutdown()


def test_remote_prefills_move_their_kv_over_mutual_tls(pools):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = [GenerateRequest(f"tls-{i}", list(range(10 + i, 60 + i)), greedy) for i in range(3)]
    results = run_all(requests, only(pools.decode), only(pools.prefill))
    assert all(len(tokens) == 6 for tokens, _ in results)
    stats = ray.get(only(pools.decode).transfer_stats.remote())
    assert stats["remote_prefills"] >= 3 and stats["bytes_pulled"] > 0
    assert not any(stats["transfer_failures_by_reason"].values()), stats["transfer_failures_by_reason"]


def test_a_config_with_unreadable_or_non_pem_tls_files_is_refused_naming_the_file(tls_files, tmp_path):
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match=r"transfer\.tls[\s\S]*cert_file: .*not a PEM file"):
        ClusterConfig(transfer={"tls": tls_options(tls_files, cert_file=str(not_pem))})
    with pytest.raises(ValueError, match=r"transfer\.tls[\s\S]*key_file: cannot read"):
        ClusterConfig(transfer={"tls": tls_options(tls_files, key_file=str(tmp_path / "missing.pem"))})
    with pytest.raises(ValueError, match="mutual needs"):
        ClusterConfig(transfer={"tls": {**tls_options(tls_files, mutual=True), "ca_file": None}})
