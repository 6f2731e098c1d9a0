"""The ingress side of a stream coalesces too: deltas that reached the ingress while its consumer was busy
(a slow client) come out of run_request as one, adding up to what a prompt consumer gets delta by delta."""
import asyncio

import pytest

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from engine.step_costs import bucket
from worker_runtime.protocol import GenerateRequest
from router.placement import feeds
from router.placement.dispatch import run_request
from router.placement.latency_report import LatencyReporter
from router.metrics import Metrics
from router.placement.calibration import PredictionErrors
from router.placement.index import PrefixIndex
from router.placement.pool_policy import Placement
from router.placement.request_router import RequestRouter
from router.placement.routing import LOCAL_ERRORS_MIN_SAMPLES, RouteDecision, Router
from tests.helpers import wait_for_async
from tests.pool_helpers import OneWorkerView, collect, only

PROMPT = [11, 23, 5, 81, 402, 77, 19, 3, 260, 14, 9, 55]


@pytest.fixture(scope="module")
def decode(ray_cluster, tiny_llama_dir):
    pools = Pools(ClusterConfig(model=tiny_llama_dir, mode="colocated", name="coalesce",
                                engine={"num_kv_blocks": 64}))
    pools.start()
    yield only(pools.decode)
    pools.shutdown()


def all_delivered() -> bool:
    """Whether every request on this event loop's feeds has all its deltas on this side: a feed drops a
    request's stream once the worker's last item for it has arrived (router/placement/feeds.py)."""
    return not any(feed.streams for feed in feeds._feeds.get(asyncio.get_running_loop(), {}).values())


def read_slowly(decode, request: GenerateRequest) -> list:
    """The first delta, then the rest only once all of them have reached this side."""
    async def main() -> list:
        deltas = [await anext(stream := run_request(request, decode))]
        assert await wait_for_async(all_delivered), "the request's last delta never reached this side"
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


def test_itl_is_still_counted_per_token_when_deltas_coalesce(decode):
    metrics = Metrics()
    requests = RequestRouter(OneWorkerView(decode), metrics, LatencyReporter(controller=None))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main() -> list:
        deltas = [await anext(stream := requests.stream(GenerateRequest("itl", PROMPT, params), []))]
        assert await wait_for_async(all_delivered), "the request's last delta never reached this side"
        return deltas + [d async for d in stream]

    deltas = asyncio.run(main())
    assert len(deltas) < 12
    labels = {"pool": "decode", "worker": "decode-0"}
    assert metrics.registry.get_sample_value("vllm:inter_token_latency_seconds_count", labels) == 11
    assert metrics.registry.get_sample_value("vllm:time_to_first_token_seconds_count", labels) == 1


class LocalBesideStreamsView(OneWorkerView):
    """Places every request as a chunked local prefill beside streams, predicted at MODEL_S."""
    MODEL_S = 0.05

    def __init__(self, actor):
        super().__init__(actor)
        self.router = Router(PrefixIndex(), self.block_size)

    def route(self, block_hashes, num_tokens, excluded, **options):
        return RouteDecision(Placement("decode-0", 0, 0.0), None, "prefill_queue_full", predicted_ttft_s=self.MODEL_S,
                             local_tokens=num_tokens, local_model_s=self.MODEL_S)


def test_a_local_prefills_first_token_measures_its_prediction_for_placement(decode):
    """The ingress feeds placement's local factor (Router.local_factor) from the first token of each request
    placed to prefill locally beside streams, once per request, and the gauge follows."""
    metrics = Metrics()
    view = LocalBesideStreamsView(decode)
    requests = RequestRouter(view, metrics, LatencyReporter(controller=None))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def main(i: int) -> list:
        return [d async for d in requests.stream(GenerateRequest(f"local-{i}", PROMPT, params), [])]

    for i in range(LOCAL_ERRORS_MIN_SAMPLES):
        asyncio.run(main(i))
    ratios = view.router.local_errors[bucket(len(PROMPT))].ratios
    assert len(ratios) == LOCAL_ERRORS_MIN_SAMPLES and all(r > 0 for r in ratios)
    factor = view.router.local_factor(len(PROMPT))
    low, high = PredictionErrors.BOUNDS
    assert factor == pytest.approx(min(max(sorted(ratios)[len(ratios) // 2], low), high))
    assert metrics.registry.get_sample_value("tandem:routing_local_prediction_factor",
                                             {"tokens": str(bucket(len(PROMPT)))}) == pytest.approx(factor)
