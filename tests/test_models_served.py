"""The architectures that differ from Llama, disaggregated through the server (issue 42): a Mistral-style model
(sliding window, blocks given back), Gemma 2 (soft-capping, alternating local and global layers), Qwen3
(QK-norm) and a mixture of experts (Mixtral), served at once as four models of one cluster, each with a prefill
and a decode worker. Prompts run past the windows and go to the prefill worker (the KV moves to decode); the
greedy text equals HF generate's for each model."""
import random
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from engine.model_loader import build_random_model, load_tokenizer
from tests.cluster_load import serve_tandem
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.ray

MODELS = {  # served name: (HF model type, config overrides)
    "mistral": ("mistral", dict(sliding_window=16)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-archs")
    dirs = {name: str(build_random_model(root / name, arch, seed=21, **overrides))
            for name, (arch, overrides) in MODELS.items()}
    config = ClusterConfig(name="archs", namespace="tandem-tests", engine={"num_kv_blocks": 48},
                           router={"max_local_prefill_length": 8},  # every prompt goes to the prefill worker
                           models=[{"key": name, "model": path, "served_model_name": name,
                                    "prefill": {"num_cpus": 0.25}, "decode": {"num_cpus": 0.25}}
                                   for name, path in dirs.items()])
    with serve_tandem(config) as url:
        yield url, dirs


def test_each_architecture_served_disaggregated_equals_hf(served):
    url, dirs = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(8)
    for name, model_dir in dirs.items():
        for length in (40, 75):  # past the 16-token windows
            ids = [rng.randrange(10, 2000) for _ in range(length)]
            out = client.completions.create(model=name, prompt=ids, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})  # decodes run past the window too
            expected = load_tokenizer(model_dir).decode(hf_greedy(model_dir, ids, 24), skip_special_tokens=True)
            assert out.choices[0].text == expected.rstrip("\ufffd"), f"{name}, {length}-token prompt"
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        families = {f.name: f.samples for f in text_string_to_metric_families(response.read().decode())}
    remote = {s.labels["model_name"] for s in families["tandem:prefills"] if s.labels["where"] == "remote" and s.value}
    assert remote == set(dirs)  # every model's prompts were computed by its prefill worker and pulled
    assert [s for s in families["tandem:kv_transfer_failures"] if s.value > 0] == []
