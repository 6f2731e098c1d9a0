"""Layer-wise KV pipelining on the request path: real Ray actors, real gRPC, a tiny random model.

The prefill worker leases a request's blocks when its last prompt chunk is scheduled and marks layers
ready from forward hooks; decode pulls while the prefill forward still runs. Some tests hold that forward
at its last decoder layer (a forward pre-hook added inside the prefill actor) so that "decode pulls while
prefill computes" happens on every run instead of depending on how fast the machine is.

Without layer-wise leases (the default), decode still starts alongside the prefill: it reserves the
prompt's blocks while the prefill runs and takes the prefill's result straight from the prefill worker.
Those tests hold the whole prefill forward instead.
"""
import asyncio
import random
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.layer_progress import decoder_layers
from worker_runtime.protocol import GenerateRequest
from router.placement.dispatch import run_request
from tests.hf_reference import hf_greedy
from tests.helpers import wait_for
from tests.pool_helpers import close_after, collect, only, placed, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Small token budget: prompts over 32 tokens are prefilled in several chunks.
ENGINE = {"num_kv_blocks": 96, "max_num_batched_tokens": 32}


def start_pools(name: str, model: str, layerwise: bool, prefill_tp: int = 1) -> Pools:
    pools = Pools(ClusterConfig(model=model, name=name, engine=ENGINE,
                                prefill={"resources": {"prefill_pool": 1}, "num_cpus": 1,
                                         "tensor_parallel_size": prefill_tp},
                                decode={"resources": {"decode_pool": 1}, "num_cpus": 1},
                                transfer={"lease_ttl_s": 20, "layerwise": layerwise}))
    pools.start()
    return pools


@pytest.fixture(scope="module")
def layerwise(ray_cluster, tiny_llama_dir):
    pools = start_pools("lw", tiny_llama_dir, layerwise=True)
    yield pools
    pools.shutdown()


@pytest.fixture(scope="module")
def normal(ray_cluster, tiny_llama_dir):
    pools = start_pools("lw-normal", tiny_llama_dir, layerwise=False)
    yield pools
    pools.shutdown()


@pytest.fixture(scope="module")
def layerwise_tp(ray_cluster, tiny_llama_dir):
    """Layer-wise leases from a prefill worker of two tensor-parallel ranks into a decode worker of one."""
    pools = start_pools("lw-tp", tiny_llama_dir, layerwise=True, prefill_tp=2)
    yield pools
    pools.shutdown()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def run_on(pools, reqs):
    return run_all(reqs, only(pools.decode), only(pools.prefill), pools.config.transfer.layerwise)


def on_worker(actor, fn):
    return ray.get(actor.__ray_call__.remote(fn))


def hold_forward(actor, until) -> None:
    """Inside the prefill actor: hold each forward that writes layer-wise leased KV before its last
    decoder layer until `until(worker)` holds (at most 20 s)."""
    def install(worker):
        def pre_hook(module, args):
            deadline = time.monotonic() + 20
            while worker.layer_progress.watched and not until(worker) and time.monotonic() < deadline:
                time.sleep(0.002)
        worker.test_hold = decoder_layers(worker.engine.runner.model)[-1].register_forward_pre_hook(pre_hook)
    on_worker(actor, install)


def release_forward(actor) -> None:
    on_worker(actor, lambda worker: worker.test_hold.remove())


def assert_nothing_held(pools):
    prefill, decode = only(pools.prefill), only(pools.decode)
    assert wait_for(lambda: ray.get(decode.stats.remote()).num_active_blocks == 0)
    assert wait_for(lambda: ray.get(prefill.stats.remote()).num_active_blocks == 0)
    assert wait_for(lambda: ray.get(prefill.num_leases.remote()) == 0)
    assert wait_for(lambda: ray.get(decode.num_in_flight.remote()) == 0)
    assert wait_for(lambda: ray.get(prefill.num_in_flight.remote()) == 0)


def test_layerwise_greedy_outputs_equal_normal_disaggregation_and_hf(layerwise, normal, tiny_llama_dir):
    lengths = [5, 17, 31, 48, 77, 120]  # one to four prefill chunks of 32 tokens
    prompts = [prompt(i, n) for i, n in enumerate(lengths)]
    before = ray.get(only(layerwise.prefill).transfer_stats.remote())["layerwise_leases"]
    lw = run_on(layerwise, [GenerateRequest(f"lw-{i}", p, GREEDY) for i, p in enumerate(prompts)])
    base = run_on(normal, [GenerateRequest(f"nm-{i}", p, GREEDY) for i, p in enumerate(prompts)])
    for p, (lw_tokens, _), (base_tokens, _) in zip(prompts, lw, base):
        assert lw_tokens == base_tokens == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens)
    assert ray.get(only(layerwise.prefill).transfer_stats.remote())["layerwise_leases"] == before + len(prompts)
    # Every prompt was leased early; a prompt whose first token is out by the time the prefill worker
    # answers (a one-chunk prompt on this tiny model, now and then) is handed over the ordinary way.
    stats = ray.get(only(layerwise.decode).transfer_stats.remote())
    assert 1 <= stats["layerwise_pulls"] <= len(prompts), stats
    assert_nothing_held(layerwise)


def test_layerwise_pulls_from_a_tensor_parallel_prefill_worker_give_hfs_tokens(layerwise_tp, tiny_llama_dir):
    """A layer marked ready on rank 0 is ready on every rank: the layer's all-reduces come after its KV writes."""
    prompts = [prompt(50 + i, n) for i, n in enumerate([17, 48, 77, 120])]
    before = ray.get(only(layerwise_tp.prefill).transfer_stats.remote())["layerwise_leases"]
    got = run_on(layerwise_tp, [GenerateRequest(f"lwtp-{i}", p, GREEDY) for i, p in enumerate(prompts)])
    for p, (tokens, _) in zip(prompts, got):
        assert tokens == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens)
    assert ray.get(only(layerwise_tp.prefill).transfer_stats.remote())["layerwise_leases"] == before + len(prompts)
    assert ray.get(only(layerwise_tp.decode).transfer_stats.remote())["transfer_failures"] == 0
    assert_nothing_held(layerwise_tp)


def test_decode_pull_is_open_before_the_prefill_forward_ends(layerwise, tiny_llama_dir):
    prefill, decode = only(layerwise.prefill), only(layerwise.decode)
    # Released as soon as a pull is open: only a pull started during the forward can release it.
    hold_forward(prefill, lambda worker: worker.kv_server.leases.num_active_pulls > 0)
    try:
        before = ray.get(prefill.transfer_stats.remote())
        p = prompt(40, 70)
        [(tokens, deltas)] = run_on(layerwise, [GenerateRequest("overlap-1", p, GREEDY)])
        after = ray.get(prefill.transfer_stats.remote())
    finally:
        release_forward(prefill)
    assert after["forwards_ended_with_pull_open"] == before["forwards_ended_with_pull_open"] + 1
    assert tokens == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens)
    times = deltas[-1].times  # decode's stamps: it was handed the KV before the first token existed
    assert "transfer_done" in times and ray.get(decode.transfer_stats.remote())["layerwise_pulls"] >= 1
    assert_nothing_held(layerwise)


def test_abort_mid_prefill_frees_blocks_and_leases_on_both_workers(layerwise):
    prefill = only(layerwise.prefill)
    on_worker(prefill, lambda worker: setattr(worker, "test_go", False))
    hold_forward(prefill, lambda worker: worker.test_go)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(collect(GenerateRequest("abort-pf", prompt(41, 90), params),
                                             only(layerwise.decode), prefill, layerwise=True))
        # Decode is pulling (waiting for the held last layer) while the prefill forward is held.
        opened = await asyncio.to_thread(
            wait_for, lambda: on_worker(prefill, lambda worker: worker.kv_server.leases.num_active_pulls) > 0)
        task.cancel()
        await asyncio.wait([task])
        return opened

    try:
        assert asyncio.run(main())
    finally:
        on_worker(prefill, lambda worker: setattr(worker, "test_go", True))
        release_forward(prefill)
    assert_nothing_held(layerwise)


def test_abort_mid_stream_frees_blocks_and_leases_on_both_workers(layerwise):
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def main():
        stream = run_request(placed(GenerateRequest("abort-ds", prompt(42, 60), params), True, layerwise=True),
                             only(layerwise.decode), only(layerwise.prefill))
        await close_after(stream, 5)

    asyncio.run(main())
    assert_nothing_held(layerwise)


def test_max_tokens_one_pulls_nothing(layerwise, tiny_llama_dir):
    prefill, decode = only(layerwise.prefill), only(layerwise.decode)
    before_p, before_d = ray.get(prefill.transfer_stats.remote()), ray.get(decode.transfer_stats.remote())
    p = prompt(43, 50)
    [(tokens, deltas)] = run_on(layerwise, [GenerateRequest("one-1", p, SamplingParams(temperature=0.0, max_tokens=1))])
    after_p, after_d = ray.get(prefill.transfer_stats.remote()), ray.get(decode.transfer_stats.remote())
    assert tokens == hf_greedy(tiny_llama_dir, p, 1)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert after_p["bytes_sent"] == before_p["bytes_sent"]
    assert after_p["layerwise_leases"] == before_p["layerwise_leases"]
    assert after_d == before_d
    assert_nothing_held(layerwise)


def test_request_stopped_by_its_first_token_leaves_no_lease(layerwise, tiny_llama_dir):
    p = prompt(44, 40)
    first = hf_greedy(tiny_llama_dir, p, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[first])
    before = ray.get(only(layerwise.decode).transfer_stats.remote())
    [(tokens, deltas)] = run_on(layerwise, [GenerateRequest("stop-1", p, params)])
    assert tokens == [first] and deltas[-1].finish_reason == "stop"
    assert ray.get(only(layerwise.decode).transfer_stats.remote())["remote_prefills"] == before["remote_prefills"]
    assert_nothing_held(layerwise)


def test_prefill_failing_after_its_early_lease_releases_it(layerwise):
    prefill = only(layerwise.prefill)

    def install(worker):
        def fail(module, args):
            if worker.layer_progress.watched:
                raise RuntimeError("injected forward failure")
        worker.test_hold = decoder_layers(worker.engine.runner.model)[-1].register_forward_pre_hook(fail)

    on_worker(prefill, install)
    before = ray.get(prefill.transfer_stats.remote())["layerwise_leases"]
    try:
        [(tokens, deltas)] = run_on(layerwise, [GenerateRequest("fail-1", prompt(45, 40), GREEDY)])
    finally:
        release_forward(prefill)
    assert tokens == [] and deltas[-1].finish_reason == "error"
    assert ray.get(prefill.transfer_stats.remote())["layerwise_leases"] == before + 1
    assert_nothing_held(layerwise)


# ---- the default handoff: decode reserves while the prefill runs --------------------------------------

def hold_whole_forward(actor) -> None:
    """Inside the prefill actor: hold each forward before its last decoder layer until `worker.test_go`
    (at most 20 s)."""
    def install(worker):
        worker.test_go = False

        def pre_hook(module, args):
            deadline = time.monotonic() + 20
            while not worker.test_go and time.monotonic() < deadline:
                time.sleep(0.002)
        worker.test_hold = decoder_layers(worker.engine.runner.model)[-1].register_forward_pre_hook(pre_hook)
    on_worker(actor, install)


def let_go(actor) -> None:
    def go(worker):
        worker.test_go = True
        worker.test_hold.remove()
    on_worker(actor, go)


def test_decode_reserves_blocks_while_the_prefill_runs(normal, tiny_llama_dir):
    prefill, decode = only(normal.prefill), only(normal.decode)
    p = prompt(50, 70)
    hold_whole_forward(prefill)

    async def main():
        task = asyncio.ensure_future(collect(GenerateRequest("alongside-1", p, GREEDY), decode, prefill))
        reserved = await asyncio.to_thread(wait_for, lambda: ray.get(decode.stats.remote()).num_active_blocks > 0)
        leases = ray.get(prefill.num_leases.remote())  # the prefill has not answered yet
        let_go(prefill)
        return reserved, leases, await task

    try:
        reserved, leases, (tokens, deltas) = asyncio.run(main())
    finally:
        on_worker(prefill, lambda worker: setattr(worker, "test_go", True))
    assert reserved and leases == 0
    assert tokens == hf_greedy(tiny_llama_dir, p, GREEDY.max_tokens)
    # The pull began after the prefill's answer (the prefill worker's stamp, on the first token's delta).
    times = deltas[-1].times
    assert deltas[0].times["prefill_done"] <= times["transfer_started"] <= times["transfer_done"]
    # Each engine stamps the one timeline: the prefill engine its prompt's scheduling, the decode engine
    # its first step over the imported KV.
    assert deltas[0].times["prefill_started"] <= deltas[0].times["prefill_done"]
    assert times["transfer_done"] <= times["decode_started"]
    assert ray.get(decode.transfer_stats.remote())["transfer_failures"] == 0
    assert_nothing_held(normal)


def test_abort_during_the_prefill_frees_decodes_reservation(normal):
    prefill, decode = only(normal.prefill), only(normal.decode)
    hold_whole_forward(prefill)

    async def main():
        task = asyncio.ensure_future(collect(GenerateRequest("alongside-abort", prompt(51, 90), GREEDY),
                                             decode, prefill))
        reserved = await asyncio.to_thread(wait_for, lambda: ray.get(decode.stats.remote()).num_active_blocks > 0)
        task.cancel()
        await asyncio.wait([task])
        return reserved

    try:
        assert asyncio.run(main())
    finally:
        let_go(prefill)
    assert_nothing_held(normal)


def test_failed_prefill_frees_decodes_reservation(normal):
    # A prefill worker refuses a request that already has output tokens; decode, started alongside,
    # hears of it from the same result.
    request = GenerateRequest("alongside-fail", prompt(52, 40), GREEDY, output_token_ids=[7, 8])
    with pytest.raises(InvalidRequestError):
        run_on(normal, [request])
    assert_nothing_held(normal)


def test_first_token_that_finishes_the_request_frees_decodes_reservation(normal, tiny_llama_dir):
    p = prompt(53, 60)
    first = hf_greedy(tiny_llama_dir, p, 1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first])
    [(tokens, deltas)] = run_on(normal, [GenerateRequest("alongside-stop", p, params)])
    assert tokens == [first] and deltas[-1].finish_reason == "stop"
    assert_nothing_held(normal)
