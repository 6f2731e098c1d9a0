"""Shared fixtures: tiny random-weight models built once per session, the default model and the Ray cluster;
and the two test tiers. A test that starts Ray is marked `ray` (automatically when it uses a fixture in
RAY_FIXTURES) and runs in the serial tier with the `slow` tests; the rest is the parallel tier
(`make test-fast`: pytest-xdist, `-m "not ray and not slow"`), where starting Ray fails the test."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TANDEM_NUM_THREADS", "2")
# `dtype: auto` on a CPU with native bf16 runs bfloat16; the suite checks results against fp32 references,
# so it pins fp32 here (its workers inherit this), and tests/test_dtype_auto.py covers the bf16 default.
os.environ.setdefault("TANDEM_CPU_AUTO_DTYPE", "float32")
# Tests talk to 127.0.0.1 only: keep Ray on loopback too, and skip its token auth prompt.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Fixtures that start Ray: a test using one, directly or through another fixture, is marked `ray`.
RAY_FIXTURES = {"ray_cluster", "simulated_hosts"}
RAY_TRAP = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if RAY_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.ray)


@pytest.hookimpl(trylast=True)  # after `-m` deselected: these are the tests this process runs
def pytest_collection_finish(session):
    """In a run of the parallel tier alone, Ray's temp dir moves to an empty trap dir (in this process and
    every process it starts, `tandem serve` included), so that a Ray start anywhere leaves a trace there."""
    if any(item.get_closest_marker("ray") or item.get_closest_marker("slow") for item in session.items):
        return
    trap = Path(tempfile.mkdtemp(prefix="tdm-noray-"))  # short: Ray's socket paths live under it
    os.environ["RAY_TMPDIR"] = str(trap)
    session.config.stash[RAY_TRAP] = trap
    session.config.add_cleanup(lambda: shutil.rmtree(trap, ignore_errors=True))


@pytest.fixture(autouse=True)
def _no_ray_in_the_parallel_tier(request):
    """Fails a test that started Ray in a run of the parallel tier: that Ray would hold none of the machine's
    Ray lock, and share the cores with the other workers' tests."""
    yield
    trap = request.config.stash.get(RAY_TRAP, None)
    if trap is not None and (trap / "ray").exists():
        shutil.rmtree(trap / "ray", ignore_errors=True)  # one failure per Ray start, not one per later test
        pytest.fail("this test started Ray: use the ray_cluster fixture, or mark it `ray` "
                    "(pytestmark = pytest.mark.ray) so that it runs in the serial tier", pytrace=False)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from engine.model_loader import build_random_model
    return str(build_random_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    from engine.model_loader import build_random_model
    return str(build_random_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "qwen2", seed=1))


@pytest.fixture(scope="session")
def smollm2_dir():
    from engine.model_loader import default_model_dir
    return str(default_model_dir())


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama_dir):
    from engine import Engine, EngineConfig
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=256))


@pytest.fixture(scope="session")
def ray_cluster():
    """One simulated two-node Ray cluster for the whole session: the head node offers the custom
    resource `prefill_pool`, the second node `decode_pool`, so pools can be pinned to node groups."""
    import ray
    from ray.cluster_utils import Cluster

    # The one HTTP proxy (on the head) would send every request to the ingress replica on its own node; in a
    # real cluster each node's proxy feeds its node's replica. Here requests spread over the replicas at random,
    # so that tests of several replicas reach them all (the variable reaches the proxy through the raylets).
    os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {"prefill_pool": 100}, "include_dashboard": False})
    cluster.add_node(num_cpus=8, resources={"decode_pool": 100})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="tandem-tests", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def simulated_hosts():
    """Hosts a, b, c, d as network namespaces on a bridge (bench/netns.py), holding the machine's Ray lock;
    the test module starts Ray nodes on them. Everything is removed when the module ends or fails."""
    import tempfile
    from pathlib import Path

    from bench.netns import SimulatedHosts, ray_lock, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    # Ray must notice a host whose link went down within seconds, not its default 30 s.
    ray_env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "3"}
    with ray_lock():
        workdir = Path(tempfile.mkdtemp(prefix="tdm"))  # short: Ray's socket paths live under it
        with SimulatedHosts("abcd", workdir, ray_env) as hosts:
            yield hosts


# A Hermes-style template: tools in the system turn, calls as <tool_call> JSON, results as <tool_response>,
# and a generation prompt that opens the assistant's thinking.
AGENT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nFunctions you may call:\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.role == 'assistant' and message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}"
    "{%- elif message.role == 'tool' %}<tool_response id=\"{{ message.tool_call_id }}\">{{ message.content }}"
    "</tool_response>{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
AGENT_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", AGENT_CALL]


@pytest.fixture(scope="session")
def tiny_agent_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with AGENT_TOKENS as single (non-special) tokens and AGENT_TEMPLATE as its chat
    template, rigged as a bigram model (each next token depends on the last one alone) in which
    <tool_call> is followed by AGENT_CALL, </tool_call> and EOS: a request that makes it write <tool_call>
    (a logit bias) gets a whole Hermes call, written by the model token by token."""
    from transformers import AutoModelForCausalLM

    from engine.model_loader import load_tokenizer
    out = tmp_path_factory.mktemp("models") / "tiny-agent"
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.add_tokens(AGENT_TOKENS)
    tokenizer.chat_template = AGENT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    chain = [tokenizer.convert_tokens_to_ids(t) for t in AGENT_TOKENS[2:3] + AGENT_TOKENS[4:] + AGENT_TOKENS[3:4]]
    _rig_bigram_chain(model, chain + [tokenizer.eos_token_id])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def _rig_bigram_chain(model, chain: list[int]) -> None:
    """Zero each layer's contribution to the residual stream, so the logits are a function of the last
    token alone, and give dimension i of the hidden state to chain[i]: it then predicts chain[i + 1] with
    a logit of about 800 where every other token gets 0 (and other tokens never reach those dimensions)."""
    import torch
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, :len(chain) - 1] = 0.0
        head[:, :len(chain) - 1] = 0.0
        for i, (token, successor) in enumerate(zip(chain, chain[1:])):
            embed[token] = 0.0
            embed[token, i] = 1.0
            head[successor, i] = 100.0
