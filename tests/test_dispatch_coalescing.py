"""The ingress side of a stream coalesces too: deltas that reached the ingress while its consumer was busy
(a slow client) come out of run_request as one, adding up to what a prompt consumer gets delta by delta."""
import asyncio

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from router.dispatch import run_request
from router.latency_report import LatencyReporter
from router.metrics import Metrics
from router.policy import Placement, RouteDecision
from router.request_router import RequestRouter
from tests.pool_helpers import collect, only, wait_for

PROMPT = [11, 23, 5, 81, 402, 77, 19, 3, 260, 14, 9, 55]


@pytest.fixture(scope="module")
def decode(ray_cluster, tiny_llama_dir):
    pools = Pools(ClusterConfig(model=tiny_llama_dir, mode="colocated", name="coalesce",
                                engine={"num_kv_blocks": 64}))
    pools.start()
    yield only(pools.decode)
    pools.shutdown()


def read_slowly(decode, request: GenerateRequest) -> list:
    """The first delta, then the rest only once the worker is done with the request."""
    async def main() -> list:
        deltas = [await anext(stream := run_request(request, decode))]
        # The worker stays busy with a request until its last delta is handed to Ray; then give the
        # deltas in flight a moment to land on this side.
        await asyncio.to_thread(wait_for, lambda: ray.get(decode.num_in_flight.remote()) == 0)
        await asyncio.sleep(0.5)
        deltas += [d async for d in stream]
        return deltas

    return asyncio.run(main())


def check_adds_up(decode, params: SamplingParams) -> list:
    """Read the same request promptly and slowly; the slow reader's deltas add up to the prompt one's."""
    tokens, prompt_deltas = asyncio.run(collect(GenerateRequest("prompt-reader", PROMPT, params), decode))
    slow = read_slowly(decode, GenerateRequest("slow-reader", PROMPT, params))
    assert sum((d.new_token_ids for d in slow), []) == tokens
    assert "".join(d.new_text for d in slow) == "".join(d.new_text for d in prompt_deltas)
    assert sum((d.new_logprobs for d in slow), []) == sum((d.new_logprobs for d in prompt_deltas), [])
    assert (slow[-1].finish_reason, slow[-1].stop_reason) == (prompt_deltas[-1].finish_reason,
                                                              prompt_deltas[-1].stop_reason)
    assert slow[-1].finished and "finished" in slow[-1].times
    assert len(slow) < len(tokens)  # coalesced, not one delta per token
    return slow


def test_deltas_a_slow_consumer_missed_come_as_one_with_their_logprobs(decode):
    check_adds_up(decode, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2))


def test_a_stop_string_in_coalesced_deltas_still_ends_the_text_before_it(decode):
    _, deltas = asyncio.run(collect(GenerateRequest("no-stop", PROMPT, SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True)), decode))
    text = "".join(d.new_text for d in deltas)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    slow = check_adds_up(decode, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert slow[-1].finish_reason == "stop" and stop not in "".join(d.new_text for d in slow)


class OneWorkerView:
    """Just enough of a WorkerView for a RequestRouter over one decode worker."""
    block_size = 16

    def __init__(self, actor):
        self.decode = actor

    def route(self, block_hashes, num_tokens, excluded, **options):
        return RouteDecision(Placement("decode-0", 0, 0.0), None, "only worker")

    def begin(self, decision, request_id, num_tokens):
        pass

    def end(self, decision, request_id):
        pass

    def actor(self, worker_id):
        return self.decode


def test_itl_is_still_counted_per_token_when_deltas_coalesce(decode):
    metrics = Metrics()
    requests = RequestRouter(OneWorkerView(decode), metrics, LatencyReporter(controller=None))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main() -> list:
        deltas = [await anext(stream := requests.stream(GenerateRequest("itl", PROMPT, params), []))]
        await asyncio.to_thread(wait_for, lambda: ray.get(decode.num_in_flight.remote()) == 0)
        await asyncio.sleep(0.5)
        return deltas + [d async for d in stream]

    deltas = asyncio.run(main())
    assert len(deltas) < 12
    labels = {"pool": "decode", "worker": "decode-0"}
    assert metrics.registry.get_sample_value("vllm:inter_token_latency_seconds_count", labels) == 11
    assert metrics.registry.get_sample_value("vllm:time_to_first_token_seconds_count", labels) == 1
