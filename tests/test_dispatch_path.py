"""The dispatch path a placed request carries to the dispatcher and both workers (router/placement/routing.py)."""
from engine.sampling_params import SamplingParams
from router.placement.routing import dispatch_path
from worker_runtime.protocol import DispatchPath, GenerateRequest


def request(**params) -> GenerateRequest:
    return GenerateRequest("r", [1, 2, 3], SamplingParams(**params))


def test_a_request_placed_without_a_prefill_worker_is_prefilled_by_its_decode_worker():
    assert dispatch_path(request(max_tokens=8), remote=False, layerwise=True) is DispatchPath.LOCAL


def test_decode_starts_beside_the_prefill():
    assert dispatch_path(request(max_tokens=8), remote=True, layerwise=False) is DispatchPath.REMOTE


def test_layerwise_prefill_workers_hand_decode_the_kv_before_the_first_token():
    assert dispatch_path(request(max_tokens=None), remote=True, layerwise=True) is DispatchPath.LAYERWISE


def test_candidates_wait_for_the_first_token_they_fork_from():
    for layerwise in (False, True):
        assert dispatch_path(request(n=3, max_tokens=8), remote=True, layerwise=layerwise) is DispatchPath.SEQUENTIAL


def test_a_single_token_request_never_reaches_decode_early():
    for layerwise in (False, True):
        assert dispatch_path(request(max_tokens=1), remote=True, layerwise=layerwise) is DispatchPath.SEQUENTIAL


def test_a_candidate_alone_has_its_own_id_and_seed_and_the_same_prompt():
    group = GenerateRequest("g", [1, 2, 3], SamplingParams(n=3, seed=7), cache_salt="s")
    alone = group.candidate(2)
    assert alone.request_id != group.request_id and alone.num_outputs == 1
    assert alone.sampling_params == group.candidate_params(2) and alone.sampling_params.seed != 7
    assert (alone.prompt_token_ids, alone.cache_salt) == ([1, 2, 3], "s")
