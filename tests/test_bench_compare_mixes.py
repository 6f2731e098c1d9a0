"""bench/compare_mixes.py: compare.py case a's mixes, per-phase first-token breakdowns and ratio rows, as plain
functions (no server, no Ray)."""
from __future__ import annotations

import math

from bench import compare_mixes, serve, serve_data
from bench.serve_client import parse_counters
from bench.serve_data import TokenSpace

SPACE = TokenSpace(vocab_size=1000, special_ids=frozenset({0, 1, 2}))


def sessions_of(mix: str, n: int = 16, seed: int = 3):
    return serve.build_sessions(serve.build_parser().parse_args(compare_mixes.MIXES[mix] + ["--num-prompts", str(n)]),
                                SPACE, seed)


def test_long_mix_prompts_lie_between_1k_and_4k_tokens_with_short_outputs():
    turns = [s.turns[0] for s in sessions_of("long", 64)]
    assert all(1024 <= t.prompt_len <= 4096 for t in turns)
    assert all(25 <= t.output_len <= 103 for t in turns)  # 64 · [0.4, 1.6], as vLLM's --random-range-ratio
    assert max(t.prompt_len for t in turns) - min(t.prompt_len for t in turns) > 1000  # spread, not one length


def test_prefix_mix_shares_a_long_prefix_between_requests():
    prompts = [s.turns[0].prompt_token_ids for s in sessions_of("prefix", 16)]
    assert len({tuple(p[:1536]) for p in prompts}) == 4
    assert len({tuple(p) for p in prompts}) == 16 and all(len(p) == 1536 + 64 for p in prompts)


def test_every_mix_draws_fresh_prompts_per_seed():
    for mix in compare_mixes.MIXES:
        first = [s.turns[0].prompt_token_ids[:64] for s in sessions_of(mix, 4, seed=1)]
        second = [s.turns[0].prompt_token_ids[:64] for s in sessions_of(mix, 4, seed=2)]
        assert not set(map(tuple, first)) & set(map(tuple, second))


def test_every_mix_has_rates_below_and_past_capacity():
    assert set(compare_mixes.DEFAULT_RATES) == set(compare_mixes.MIXES)
    assert all(len(rates) >= 2 and rates == sorted(rates) for rates in compare_mixes.DEFAULT_RATES.values())


def timeline(path: str, **gaps_ms: float) -> dict:
    """Stage times from consecutive gaps in ms, starting at arrival = 100 s."""
    times, t = {"arrival": 100.0}, 100.0
    for stage, ms in gaps_ms.items():
        t += ms / 1000
        times[stage] = t
    return {"times": times, "prefill_path": path}


def request(ttft_ms: float, tl: dict) -> dict:
    return {"success": True, "ttft": ttft_ms / 1000, "timeline": tl}


def test_phase_ms_groups_consecutive_stage_gaps_into_phases():
    tl = timeline("remote", validated=1, tokenized=2, routed=3, prefill_queued=4, prefill_started=5,
                  prefill_done=100, transfer_started=6, transfer_done=20, decode_admitted=7, decode_started=8,
                  first_token=9)
    got = compare_mixes.phase_ms(tl)
    expected = {"validation": 1, "tokenization": 2, "routing": 3, "queue": 9, "prefill": 100, "transfer": 26,
                "decode admission": 15, "first token out": 9}
    assert got.keys() == expected.keys()
    assert all(math.isclose(got[k], v, abs_tol=1e-6) for k, v in expected.items())


def test_stage_breakdown_splits_by_prefill_path_with_shares_and_client_residual():
    remote = timeline("remote", routed=10, prefill_started=40, prefill_done=200, transfer_done=30, first_token=20)
    local = timeline("local", routed=10, decode_admitted=2, prefill_queued=1, prefill_started=2, first_token=105)
    out = compare_mixes.stage_breakdown([request(310, remote), request(310, remote), request(125, local),
                                         {"success": False, "ttft": 0, "timeline": None}])
    assert out["n"] == 3 and out["share"] == {"remote": 2 / 3, "local": 1 / 3}
    assert math.isclose(out["remote"]["prefill"], 200) and math.isclose(out["local"]["prefill"], 105)
    assert math.isclose(out["remote"]["transfer"], 30) and "transfer" not in out["local"]
    assert math.isclose(out["remote"]["client"], 10) and math.isclose(out["local"]["client"], 5)
    assert "first token out" not in out["local"]  # a local prefill's first token ends its prefill
    assert math.isclose(out["all"]["TTFT"], 310)


def test_stage_breakdown_of_an_untraced_run_is_empty():
    assert compare_mixes.stage_breakdown([{"success": True, "ttft": 0.1, "timeline": None}]) == {}


def test_vllm_breakdown_takes_means_from_histogram_sums_and_counts():
    text = ('vllm:request_queue_time_seconds_sum{model_name="m"} 3.0\n'
            'vllm:request_queue_time_seconds_count{model_name="m"} 4.0\n'
            'vllm:request_prefill_time_seconds_sum{model_name="m"} 2.0\n'
            'vllm:request_prefill_time_seconds_count{model_name="m"} 4.0\n'
            'vllm:request_queue_time_seconds_bucket{le="0.3",model_name="m"} 1.0\n')
    series = parse_counters(text)
    assert not any("_bucket" in s for s in series)
    assert compare_mixes.vllm_breakdown(series) == {"queue": 750.0, "prefill": 500.0}


def summary(throughput: float, ttft_p50: float, goodput: float, attainment: float) -> dict:
    dist = {"median": ttft_p50, "p99": 2 * ttft_p50}
    return {"request_throughput": throughput, "ttft_ms": dist, "itl_ms": dist, "tpot_ms": dist,
            "goodput": goodput, "slo_attainment": attainment, "completed": 10, "failed": 0}


def test_comparison_rows_give_both_sides_and_their_ratio_per_rate():
    t = [{"request_rate": 1.0, "summary": summary(1.0, 100, 0.9, 0.9)}]
    v = [{"request_rate": 1.0, "summary": summary(2.0, 200, 1.8, 0.9)}]
    rows = compare_mixes.comparison_rows("long", t, v)
    assert len(rows) == 3 and "| tandem |" in rows[0] and "| vLLM |" in rows[1]
    assert "| **÷** | 0.50× | 0.50× / 0.50× |" in rows[2] and "0.50× | |" in rows[2]
    assert "0.90 (90%)" in rows[0] and "10 / 0" in rows[0]


def test_goodput_is_requests_per_second_meeting_both_slos():
    assert compare_mixes.goodput(summary(1, 1, 0.75, 0.5)) == (0.75, 0.5)
    assert all(math.isnan(x) for x in compare_mixes.goodput({}))


def test_random_mix_matches_serve_datas_random_sessions():
    mine = [s.turns[0].prompt_token_ids for s in sessions_of("random", 4, seed=9)]
    assert mine == [s.turns[0].prompt_token_ids for s in serve_data.random_sessions(SPACE, 4, 256, 64, 9)]


def test_prefill_work_counts_only_the_uncached_prompt_and_the_share_of_hits():
    hit = {**timeline("remote", prefill_done=100), "prefill_forward_s": 0.5, "prefill_overlap_blocks": 96}
    miss = {**timeline("local", first_token=100), "prefill_forward_s": 4.0, "decode_overlap_blocks": 0}
    out = compare_mixes.prefill_work([{"prompt_len": 1600, "timeline": hit}, {"prompt_len": 1600, "timeline": miss}])
    assert out["hit_share"] == 0.5
    assert out["tok_per_s"] == (64 / 0.5 + 1600 / 4.0) / 2  # (1600 - 96 · 16) tokens in 0.5 s; 1600 in 4 s
    assert out["forward_ms"] == 2250


def test_compare_pins_bfloat16_on_both_sides_by_default_and_smoke_stays_small(tmp_path):
    from bench import compare

    cfg = compare.parse_args(["--result-dir", str(tmp_path)])
    assert cfg.dtype == "bfloat16" and cfg.rates is None and cfg.mixes.split(",") == list(compare_mixes.MIXES)
    assert compare.vllm(cfg.dtype).argv[:2] == ["env", "VLLM_DTYPE=bfloat16"]
    smoke = compare.parse_args(["--smoke", "--result-dir", str(tmp_path)])
    assert smoke.mix_prompts == 8 and smoke.rates == [1.0]
