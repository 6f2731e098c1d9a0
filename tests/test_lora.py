"""LoRA adapters (engine/lora.py): a batch mixing adapters and the base model equals, per adapter, HF generate on
PEFT's merged model; slots rotate under max_loras; an adapter's prefix never serves another or the base; what
cannot be served exactly is refused, naming why."""
import json
import random
from collections import defaultdict

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.errors import InvalidRequestError
from engine.hashing import block_hashes
from engine.lora import build_random_adapter, merged_model_dir
from engine.lora_request import LoRAError, LoRARequest
from engine.model_loader import build_random_model
from tests.hf_reference import hf_greedy

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # rank, targets, rsLoRA: three different shapes of adapter
    "all-r8": dict(seed=1, rank=8, target_modules=ALL),
    "qv-r4": dict(seed=2, rank=4, target_modules=("q_proj", "v_proj")),
    "mlp-r16-rs": dict(seed=3, rank=16, target_modules=("up_proj", "down_proj"), use_rslora=True),
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """Per base architecture: (base dir, {adapter name: adapter dir}, {adapter name: merged dir})."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for arch, kwargs in {"llama": {}, "qwen3": dict(head_dim=16)}.items():  # fused CPU layers; HF's layers
        base = str(build_random_model(root / arch, arch, seed=0, **kwargs))
        adapters = {name: str(build_random_adapter(base, root / f"{arch}-{name}", **spec))
                    for name, spec in ADAPTERS.items()}
        merged = {name: str(merged_model_dir(base, path, root / f"{arch}-{name}-merged"))
                  for name, path in adapters.items()}
        out[arch] = (base, adapters, merged)
    return out


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 40, 70)]


def run_mixed(engine: Engine, adapters: dict[str, str], prompt_list, params=PARAMS) -> dict[str, tuple]:
    """Every prompt under the base model and under each adapter, as one continuous batch."""
    runs, tokens = {}, defaultdict(list)
    for name in [None, *adapters]:
        lora = None if name is None else LoRARequest.from_dir(name, adapters[name])
        for j, prompt in enumerate(prompt_list):
            rid = f"{name}-{j}"
            engine.add_request(rid, prompt, params, lora=lora)
            runs[rid] = (name, prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return {rid: (name, prompt, tokens[rid]) for rid, (name, prompt) in runs.items()}


def assert_matches_merged(results, base, merged, max_tokens=PARAMS.max_tokens):
    for rid, (name, prompt, tokens) in results.items():
        reference = base if name is None else merged[name]
        assert tokens == hf_greedy(reference, prompt, max_tokens), f"{rid}: adapter {name}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_batch_mixing_three_adapters_and_the_base_equals_peft_merged_models(lora_models, arch):
    base, adapters, merged = lora_models[arch]
    engine = Engine(EngineConfig(model=base, num_kv_blocks=128, enable_lora=True, max_loras=4))
    assert (engine.runner.fused_layers > 0) == (arch == "llama")  # both the fused CPU path and HF's layers
    results = run_mixed(engine, adapters, prompts(engine.runner.vocab_size))
    assert_matches_merged(results, base, merged)
    stats = engine.runner.lora.stats
    assert (stats.loads, stats.evictions, stats.waits) == (3, 0, 0)


def test_the_adapters_change_the_outputs(lora_models):
    """Otherwise the test above would pass with LoRA ignored."""
    base, adapters, merged = lora_models["llama"]
    prompt = prompts(49152)[2]
    outputs = {hf_greedy(path, prompt, 12).__repr__() for path in [base, *merged.values()]}
    assert len(outputs) == 4


def test_two_slots_for_three_adapters_rotate_and_stay_exact_with_chunks_and_preemption(lora_models):
    """max_loras=2: a request waits until a slot frees (no running request uses it), then its adapter is loaded
    over the least recently used; a small pool preempts and a small token budget chunks the prompts."""
    base, adapters, merged = lora_models["llama"]
    engine = Engine(EngineConfig(model=base, num_kv_blocks=14, max_num_batched_tokens=32, enable_lora=True,
                                 max_loras=2))
    results = run_mixed(engine, adapters, prompts(engine.runner.vocab_size, seed=5))
    assert_matches_merged(results, base, merged)
    stats = engine.runner.lora.stats
    assert stats.evictions >= 1 and stats.loads == 2 + stats.evictions  # two empty slots, then one per eviction
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.lora.pins == [0, 0]  # every request gave its slot back


def test_with_one_slot_the_next_adapter_waits_for_the_running_ones(lora_models):
    base, adapters, merged = lora_models["llama"]
    engine = Engine(EngineConfig(model=base, num_kv_blocks=128, enable_lora=True, max_loras=1))
    two = {n: adapters[n] for n in ("all-r8", "qv-r4")}
    results = run_mixed(engine, two, prompts(engine.runner.vocab_size, seed=6)[:2])
    assert_matches_merged(results, base, merged)
    stats = engine.runner.lora.stats
    assert stats.waits >= 1 and (stats.loads, stats.evictions) == (2, 1)


def test_an_adapters_prefix_never_serves_the_base_or_another_adapter(lora_models):
    base, adapters, _ = lora_models["llama"]
    engine = Engine(EngineConfig(model=base, num_kv_blocks=128, enable_lora=True, max_loras=2))
    prompt = prompts(engine.runner.vocab_size)[3]  # 70 tokens: 4 full blocks
    a, b = (LoRARequest.from_dir(n, adapters[n]) for n in ("all-r8", "qv-r4"))
    bm = engine.block_manager

    def hits(lora):
        before = bm.prefix_cache_hits
        engine.generate([prompt], PARAMS) if lora is None else run_one(engine, prompt, lora)
        return bm.prefix_cache_hits - before

    assert hits(None) == 0
    assert hits(a) == 0 and hits(b) == 0  # the base's and each other's blocks are not theirs
    assert hits(a) == 64 and hits(None) == 64  # each finds its own
    assert block_hashes(prompt, 16, None, a.key)[0] not in (block_hashes(prompt, 16)[0],
                                                            block_hashes(prompt, 16, None, b.key)[0])
    assert block_hashes(prompt, 16, "t", a.key) != block_hashes(prompt, 16, "t")  # with a tenant salt too


def run_one(engine: Engine, prompt, lora: LoRARequest, rid=[0]) -> list[int]:
    rid[0] += 1
    engine.add_request(f"one-{rid[0]}", prompt, PARAMS, lora=lora)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.new_token_ids
    return tokens


def test_what_cannot_be_served_is_refused_naming_why(lora_models, tmp_path):
    base, adapters, _ = lora_models["llama"]
    prompt = [5, 6, 7]
    plain = Engine(EngineConfig(model=base, num_kv_blocks=32))
    with pytest.raises(InvalidRequestError, match="without enable_lora") as e:
        plain.add_request("x", prompt, PARAMS, lora=LoRARequest.from_dir("a", adapters["all-r8"]))
    assert e.value.field == "model"
    engine = Engine(EngineConfig(model=base, num_kv_blocks=32, enable_lora=True, max_lora_rank=8))
    with pytest.raises(InvalidRequestError, match="rank 16 exceeds max_lora_rank=8"):
        engine.add_request("x", prompt, PARAMS, lora=LoRARequest.from_dir("m", adapters["mlp-r16-rs"]))
    other = str(build_random_model(tmp_path / "wide", "llama", hidden_size=96))  # another base model
    foreign = LoRARequest.from_dir("f", build_random_adapter(other, tmp_path / "foreign", rank=4))
    with pytest.raises(InvalidRequestError, match="an adapter of another base model"):
        engine.add_request("x", prompt, PARAMS, lora=foreign)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((tmp_path / "foreign" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True, "modules_to_save": ["lm_head"]}))
    (dora / "adapter_model.safetensors").write_bytes((tmp_path / "foreign" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(InvalidRequestError, match=r"uses DoRA \(use_dora\), modules_to_save"):
        engine.add_request("x", prompt, PARAMS, lora=LoRARequest.from_dir("d", dora))
    with pytest.raises(LoRAError, match="not a PEFT adapter directory"):
        LoRARequest.from_dir("n", tmp_path)
    with pytest.raises(LoRAError, match="adapter name"):
        LoRARequest.from_dir("bad name", adapters["qv-r4"])
    assert not engine.has_unfinished_requests()


def test_an_adapter_whose_files_change_after_registration_fails_its_request_not_the_engine(lora_models, tmp_path):
    base, adapters, merged = lora_models["llama"]
    import shutil
    path = shutil.copytree(adapters["qv-r4"], tmp_path / "moving")
    lora = LoRARequest.from_dir("moving", path)
    engine = Engine(EngineConfig(model=base, num_kv_blocks=64, enable_lora=True, max_loras=1, max_cpu_loras=1))
    engine.add_request("first", [5] * 20, PARAMS, lora=lora)  # read now
    other = LoRARequest.from_dir("all", adapters["all-r8"])
    engine.add_request("other", [6] * 20, PARAMS, lora=other)  # pushes it out of host memory
    (path / "adapter_model.safetensors").write_bytes(b"truncated")
    outs = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    errors = {rid: [o.error for o in os if o.error] for rid, os in outs.items()}
    assert errors["other"] == [] and "changed since it was registered" in errors["first"][0]
    assert engine.runner.lora.pins == [0]


def test_the_fused_and_hf_paths_compute_the_same_delta(lora_models):
    """Per-row masking gives exactly the single-adapter result: a step of one adapter's rows equals the
    same rows inside a mixed step."""
    base, adapters, _ = lora_models["llama"]
    engine = Engine(EngineConfig(model=base, num_kv_blocks=64, enable_lora=True, max_loras=3))
    manager = engine.runner.lora
    slots = [manager.acquire(LoRARequest.from_dir(n, p)) for n, p in adapters.items()]
    wrapper = manager.wrappers[0]
    x = torch.randn(6, wrapper.in_features)
    rows = [slots[0], -1, slots[1], slots[2], slots[0], -1]
    manager.set_rows(rows)
    mixed = wrapper(x)
    for i, slot in enumerate(rows):
        manager.set_rows([slot])
        torch.testing.assert_close(wrapper(x[i:i + 1]), mixed[i:i + 1], rtol=1e-5, atol=1e-6, msg=f"row {i}")


def test_decode_refuses_kv_computed_under_another_adapter():
    """The KV layout check on transfer covers the adapter: a handle names the adapter its KV was computed
    with, and a decode worker whose request runs another refuses it (a layout mismatch; it computes instead)."""
    from types import SimpleNamespace

    from decode_workers.worker import DecodeWorker
    from kv_transfer.handle import KVHandle, KVTransferError
    from kv_transfer.failures import failure_reason

    pulled = []
    worker = SimpleNamespace(kv_client=SimpleNamespace(pull=lambda *a: pulled.append(a) or "stats"))
    handle = KVHandle("grpc", "127.0.0.1:1", "r", 32, (), None, lora_key="sql@abc")
    assert DecodeWorker._pull_checked(worker, handle, [1, 2], [0, 1], "sql@abc") == "stats"
    for other in ("chat@def", None):
        with pytest.raises(KVTransferError, match="LoRA adapter mismatch") as e:
            DecodeWorker._pull_checked(worker, handle, [1, 2], [0, 1], other)
        assert failure_reason(e.value) == "layout_mismatch"
    assert len(pulled) == 1
