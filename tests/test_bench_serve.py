"""bench/serve.py: datasets, arrivals and metrics as plain functions, and the streaming client against a
tiny fake OpenAI SSE server on 127.0.0.1 (no Ray, no model)."""
from __future__ import annotations

import asyncio
import json
import math
import sys

import pytest
from aiohttp import web

from bench import serve_data
from bench.serve_client import Target, counter_deltas, parse_counters, run_workload
from bench.serve_data import Session, TokenSpace, Turn
from bench.serve_metrics import (RequestResult, format_slowest, max_rate_meeting_slos, parse_slos, percentile,
                                 slowest_ttfts, summarize, summarize_by_kind)
from tests.helpers import wait_for

BODIES = web.AppKey("bodies", list)
SPACE = TokenSpace(vocab_size=1000, special_ids=frozenset({0, 1, 2}))


# ---- datasets ---------------------------------------------------------------------------------------

def test_random_prompts_have_exact_lengths_and_no_special_tokens():
    sessions = serve_data.random_sessions(SPACE, 20, input_len=256, output_len=64, seed=1)
    assert len(sessions) == 20
    for s in sessions:
        (turn,) = s.turns
        assert len(turn.prompt_token_ids) == turn.prompt_len == 256
        assert turn.output_len == 64
        assert not set(turn.prompt_token_ids) & SPACE.special_ids


def test_random_lengths_stay_within_the_range_ratio():
    sessions = serve_data.random_sessions(SPACE, 50, 100, 20, seed=3, range_ratio=0.5)
    lengths = {len(s.turns[0].prompt_token_ids) for s in sessions}
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(lengths) > 1


def test_same_seed_same_prompts_other_seed_fresh_prompts():
    a = serve_data.random_sessions(SPACE, 5, 64, 8, seed=7)
    b = serve_data.random_sessions(SPACE, 5, 64, 8, seed=7)
    c = serve_data.random_sessions(SPACE, 5, 64, 8, seed=8)
    ids = lambda sessions: [s.turns[0].prompt_token_ids for s in sessions]  # noqa: E731
    assert ids(a) == ids(b)
    assert not {tuple(x[:16]) for x in ids(a)} & {tuple(x[:16]) for x in ids(c)}


def test_prefix_repetition_shares_each_prefix_across_its_suffixes():
    sessions = serve_data.prefix_repetition_sessions(SPACE, 12, num_prefixes=3, prefix_len=32, suffix_len=8,
                                                     output_len=4, seed=0)
    by_kind: dict[str, list[list[int]]] = {}
    for s in sessions:
        ids = s.turns[0].prompt_token_ids
        assert len(ids) == 40
        by_kind.setdefault(s.kind, []).append(ids)
    assert sorted(by_kind) == ["prefix-0", "prefix-1", "prefix-2"]
    prefixes = set()
    for prompts in by_kind.values():
        assert len(prompts) == 4
        assert len({tuple(p[:32]) for p in prompts}) == 1
        assert len({tuple(p[32:]) for p in prompts}) == 4
        prefixes.add(tuple(prompts[0][:32]))
    assert len(prefixes) == 3


def test_case_c_cache_holds_a_share_of_the_prefixes_so_no_worker_holds_them_all():
    from bench.compare import prefix_case_blocks
    blocks = prefix_case_blocks(num_prefixes=8, prefix_len=512, share=0.6)
    assert blocks == int(0.6 * 8 * 32) + 64  # 8 prefixes of 32 blocks each
    assert blocks - 64 < 8 * 32 <= 2 * (blocks - 64)  # one worker cannot hold them all, two can
    assert prefix_case_blocks(8, 512, share=0) is None  # the default cache


def test_case_b_runs_each_extra_arm_with_its_own_config(tmp_path, monkeypatch):
    from bench import compare
    started = []
    monkeypatch.setattr(compare, "run_case", lambda spec, argv, rates, seed, out: started.append(spec) or {})
    cfg = compare.parse_args(["--cases", "b", "--result-dir", str(tmp_path), "--burst-no-colocated",
                              "--burst-arm", "no-slice=cpu: {borrow_slice_ms: 0}", "--burst-arm", "no-borrow=cpu: {borrow: false}"])
    compare.case_b(cfg)
    assert [spec.name for spec in started] == ["tandem-disaggregated", "no-slice", "no-borrow"]
    config = started[1].argv[started[1].argv.index("--config") + 1]
    assert open(config).read() == "cpu: {borrow_slice_ms: 0}\n"


def test_multi_turn_counts_turns_as_prompts():
    sessions = serve_data.multi_turn_sessions(SPACE, 10, turns=4, user_len=16, output_len=8, seed=0)
    assert [len(s.turns) for s in sessions] == [4, 4, 2]
    assert all(t.is_chat and t.user_text for s in sessions for t in s.turns)


def test_long_prompt_burst_mixes_a_steady_stream_with_bursts_of_long_prompts():
    sessions = serve_data.long_prompt_burst_sessions(SPACE, 20, 16, 8, 200, 2, burst_every=4, burst_size=2,
                                                     seed=0)
    kinds = [s.kind for s in sessions]
    assert len(sessions) == 20
    assert kinds[:7] == ["short"] * 4 + ["long"] * 2 + ["short"]
    assert all(s.with_previous == (s.kind == "long") for s in sessions)
    assert all(len(s.turns[0].prompt_token_ids) == (200 if s.kind == "long" else 16) for s in sessions)


# ---- arrivals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_requested_mean_rate(burstiness):
    gaps = serve_data.arrival_gaps(20000, request_rate=2.0, burstiness=burstiness, seed=0)
    assert len(gaps) / sum(gaps) == pytest.approx(2.0, rel=0.05)


def test_burstiness_changes_the_spread_not_the_mean():
    def cv(gaps):
        mean = sum(gaps) / len(gaps)
        return math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean

    poisson = serve_data.arrival_gaps(20000, 1.0, 1.0, seed=1)
    bursty = serve_data.arrival_gaps(20000, 1.0, 0.25, seed=1)
    assert cv(poisson) == pytest.approx(1.0, rel=0.1)
    assert cv(bursty) == pytest.approx(2.0, rel=0.1)


def test_infinite_rate_sends_everything_at_once_and_bursts_arrive_together():
    sessions = serve_data.long_prompt_burst_sessions(SPACE, 10, 8, 4, 32, 2, burst_every=3, burst_size=2, seed=0)
    serve_data.assign_arrivals(sessions, 1.0, 1.0, seed=0)
    assert sessions[0].arrival == 0.0
    assert all(b.arrival >= a.arrival for a, b in zip(sessions, sessions[1:]))
    for prev, s in zip(sessions, sessions[1:]):
        if s.with_previous:
            assert s.arrival == prev.arrival
    serve_data.assign_arrivals(sessions, math.inf, 1.0, seed=0)
    assert {s.arrival for s in sessions} == {0.0}


# ---- metrics ----------------------------------------------------------------------------------------

def _result(ttft, itl, tokens=None, kind="default", success=True):
    tokens = tokens if tokens is not None else len(itl) + 1
    return RequestResult(kind, 10, tokens, success=success, ttft=ttft, e2e=ttft + sum(itl), itl=list(itl),
                         output_tokens=tokens, error="" if success else "boom")


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)
    assert percentile([5], 99) == 5
    assert math.isnan(percentile([], 50))


def test_tpot_is_decode_time_over_tokens_after_the_first():
    r = _result(0.5, [0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.2)
    assert _result(0.5, []).tpot is None


def test_summary_of_synthetic_timings():
    results = [_result(0.1, [0.05] * 3), _result(0.3, [0.05, 0.15]), _result(0, [], success=False)]
    s = summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"boom": 1})
    assert s["request_throughput"] == 1.0
    assert s["total_output_tokens"] == 7 and s["output_throughput"] == 3.5
    assert s["total_input_tokens"] == 20 and s["total_token_throughput"] == 13.5
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["ttft_ms"]["median"] == pytest.approx(200)
    assert s["itl_ms"]["count"] == 5 and s["itl_ms"]["median"] == pytest.approx(50)
    assert s["itl_ms"]["p99"] == pytest.approx(146.0)  # 50 + 0.96 · 100
    assert s["tpot_ms"]["mean"] == pytest.approx((50 + 100) / 2)
    assert s["e2e_ms"]["p90"] == pytest.approx(250 + 0.9 * 250)


def test_goodput_counts_requests_meeting_every_slo():
    slos = parse_slos(["ttft:200", "tpot:100"])
    results = [_result(0.1, [0.05] * 3),   # meets both
               _result(0.3, [0.05] * 3),   # TTFT too slow
               _result(0.1, [0.5] * 3),    # TPOT too slow
               _result(0.1, [], success=False)]
    s = summarize(results, duration_s=4.0, slos=slos)
    assert s["goodput"] == 0.25
    assert s["slo_attainment"] == 0.25


def test_bad_slo_specs_are_refused():
    with pytest.raises(ValueError, match="itl"):
        parse_slos(["itl:10"])
    with pytest.raises(ValueError):
        parse_slos(["ttft"])


def test_max_rate_meeting_slos_is_the_highest_rate_before_the_first_miss():
    sweep = [(1.5, {"slo_attainment": 0.95}), (0.5, {"slo_attainment": 1.0}), (1.0, {"slo_attainment": 0.92}),
             (2.0, {"slo_attainment": 0.5})]
    assert max_rate_meeting_slos(sweep) == 1.5
    assert max_rate_meeting_slos([(0.5, {"slo_attainment": 0.5})]) is None


def test_summaries_by_kind_only_for_mixed_workloads():
    mixed = [_result(0.1, [0.01], kind="short"), _result(1.0, [0.01], kind="long")]
    by_kind = summarize_by_kind(mixed, 1.0)
    assert set(by_kind) == {"short", "long"} and by_kind["long"]["ttft_ms"]["mean"] == pytest.approx(1000)
    assert summarize_by_kind([_result(0.1, [0.01])], 1.0) == {}


def test_prometheus_counters_and_prefix_hit_rate():
    before = parse_counters('# HELP x\nvllm:prefix_cache_queries_total{worker="d0"} 100.0\n'
                            'vllm:prefix_cache_hits_total{worker="d0"} 10.0\nother_total 5\n')
    after = parse_counters('vllm:prefix_cache_queries_total{worker="d0"} 300.0\n'
                           'vllm:prefix_cache_queries_total{worker="d1"} 100.0\n'
                           'vllm:prefix_cache_hits_total{worker="d0"} 160.0\n')
    assert "other_total" not in before
    deltas = counter_deltas(before, after)
    assert deltas["totals"] == {"vllm:prefix_cache_queries": 300.0, "vllm:prefix_cache_hits": 150.0}
    assert deltas["prefix_hit_rate"] == 0.5


# ---- the client against a fake SSE server -------------------------------------------------------------

def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _fake_stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    chat = "messages" in body
    if not chat and body["prompt"][0] == 999:
        return web.json_response({"error": {"message": "bad prompt", "param": "prompt"}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if chat:
        await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    n = body["max_tokens"]
    for i in range(n):
        piece = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
        # The last chunk carries two tokens: usage, not the chunk count, gives the token count.
        if i == n - 2:
            continue
        await resp.write(_sse({"choices": [{"index": 0, "finish_reason": "length" if i == n - 1 else None,
                                            **piece}]}))
        await asyncio.sleep(0.001)  # the behaviour: tokens arrive spread out, as a server streams them
    last = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n}}
    if request.headers.get("X-Tandem-Trace") == "1":  # tandem's timeline rides on the last chunk
        times = {"arrival": 100.0, "routed": 100.004, "prefill_queued": 100.006, "prefill_started": 100.2,
                 "prefill_done": 100.5, "first_token": 100.503}
        last["tandem"] = {"request_id": "r", "timelines": [{"times": times, "prefill_path": "remote",
                                                           "routing_reason": "remote_within_ttft_slo",
                                                           "predicted_ttft_s": 0.45, "prefill_steps": 3,
                                                           "prefill_borrowed_steps": 1, "prefill_forward_s": 0.29}]}
    await resp.write(_sse(last))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
def fake_server():
    async def start():
        app = web.Application()
        app[BODIES] = []
        app.router.add_post("/v1/completions", _fake_stream)
        app.router.add_post("/v1/chat/completions", _fake_stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return app, runner, f"http://127.0.0.1:{port}"

    loop = asyncio.new_event_loop()
    app, runner, url = loop.run_until_complete(start())
    yield loop, app, url
    loop.run_until_complete(runner.cleanup())
    loop.close()


def test_client_parses_streams_counts_tokens_and_reports_a_failed_request(fake_server):
    loop, app, url = fake_server
    sessions = [Session([Turn(5, [10, 11, 12, 13], prompt_len=4)]), Session([Turn(3, [20, 21], prompt_len=2)]),
                Session([Turn(4, [999, 1], prompt_len=2)], kind="bad")]
    results, duration = loop.run_until_complete(
        run_workload(Target(url, "m", timeout_s=10), sessions, max_concurrency=2, show_progress=False))
    by_len = {r.expected_output_len: r for r in results}
    for n in (5, 3):
        r = by_len[n]
        assert r.success and r.error == ""
        assert r.output_tokens == n
        assert len(r.itl) == n - 2  # n tokens in n - 1 chunks
        assert 0 < r.ttft <= r.e2e
        assert r.finish_reason == "length"
    bad = by_len[4]
    assert not bad.success and bad.error.startswith("HTTP 400")
    summary = summarize(results, duration)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    sent = app[BODIES][0]
    assert sent["stream"] and sent["ignore_eos"] and sent["stream_options"] == {"include_usage": True}


def test_tandem_trace_keeps_each_timeline_and_pins_the_slowest_first_tokens_on_a_stage(fake_server):
    loop, app, url = fake_server
    sessions = [Session([Turn(3, [10 + i, 11], prompt_len=2)]) for i in range(3)]
    untraced, _ = loop.run_until_complete(run_workload(Target(url, "m", timeout_s=10), sessions[:1],
                                                       show_progress=False))
    assert untraced[0].timeline is None and slowest_ttfts(untraced) == []
    target = Target(url, "m", timeout_s=10, extra_headers={"X-Tandem-Trace": "1"})
    results, _ = loop.run_until_complete(run_workload(target, sessions, show_progress=False))
    assert all(r.success and r.timeline["prefill_path"] == "remote" for r in results)
    rows = slowest_ttfts(results, count=2)
    assert len(rows) == 2 and rows[0]["ttft_ms"] >= rows[1]["ttft_ms"]
    assert rows[0]["reason"] == "remote_within_ttft_slo" and rows[0]["predicted_ttft_ms"] == 450.0
    assert rows[0]["gaps_ms"] == {"routed": 4.0, "prefill_queued": 2.0, "prefill_started": 194.0,
                                  "prefill_done": 300.0, "first_token": 3.0}
    assert (rows[0]["prefill_steps"], rows[0]["prefill_borrowed_steps"], rows[0]["prefill_forward_ms"]) == (3, 1, 290.0)
    assert "prefill_done +300" in format_slowest(rows)
    assert "prefill in 3 forwards (1 borrowed), 290 ms" in format_slowest(rows)


def test_multi_turn_sends_the_conversation_so_far(fake_server):
    loop, app, url = fake_server
    session = Session([Turn(2, user_text=f"question {i}", prompt_len=2) for i in range(3)], kind="chat")
    results, _ = loop.run_until_complete(
        run_workload(Target(url, "m", endpoint="/v1/chat/completions", timeout_s=10), [session],
                     show_progress=False))
    assert [r.success for r in results] == [True] * 3
    assert [len(b["messages"]) for b in app[BODIES]] == [1, 3, 5]
    assert [r.prompt_len for r in results] == [4, 4, 4]  # the server's usage.prompt_tokens
    assert app[BODIES][1]["messages"][1] == {"role": "assistant", "content": "t1 "}


def test_a_request_past_its_deadline_fails_and_the_run_ends():
    async def slow(request):
        await asyncio.sleep(1)  # the behaviour: a server slower than the client's deadline
        return web.Response()

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/completions", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            return await run_workload(Target(url, "m", timeout_s=0.2), [Session([Turn(2, [5], prompt_len=1)])],
                                      show_progress=False)
        finally:
            await runner.cleanup()

    results, _ = asyncio.run(scenario())
    assert not results[0].success and results[0].error.startswith("timeout")


def test_results_json_and_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.serve import write_outputs

    requests = [_result(0.1, [0.05] * 3).to_dict(), _result(0.2, [0.06] * 3).to_dict()]
    runs = [{"request_rate": rate, "summary": summarize([_result(0.1 * rate, [0.05])], 1.0), "requests": requests}
            for rate in (0.5, 1.0)]
    paths = write_outputs({"runs": runs}, tmp_path, "x")
    assert [p.name for p in paths] == ["x.json", "x_cdf.png", "x_rates.png"]
    assert json.loads(paths[0].read_text())["runs"][1]["request_rate"] == 1.0
    assert all(p.stat().st_size > 1000 for p in paths[1:])


def test_without_matplotlib_the_json_is_written_and_plots_are_skipped(tmp_path, monkeypatch, capsys):
    from bench.serve import write_outputs

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    runs = [{"request_rate": 1.0, "summary": summarize([_result(0.1, [0.05])], 1.0),
             "requests": [_result(0.1, [0.05] * 3).to_dict()]}]
    paths = write_outputs({"runs": runs}, tmp_path, "x")
    assert [p.name for p in paths] == ["x.json"] and paths[0].exists()
    assert "no plots" in capsys.readouterr().out


def test_compare_stops_the_server_alone_then_kills_what_it_left(tmp_path):
    """SIGTERM reaches the server process only (tandem stops its own Ray on it); its process group is
    killed after it exits."""
    import os
    import subprocess

    from bench.compare import stop

    marker, ready = tmp_path / "child_got_sigterm", tmp_path / "child_ready"
    child = ("import signal, sys, time; "
             f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), sys.exit(0))); "
             f"open({str(ready)!r}, 'w').close(); time.sleep(60)")
    parent = (f"import signal, subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print(c.pid, flush=True); c.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child_pid = int(proc.stdout.readline())

    def child_alive() -> bool:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return False
        return True

    assert wait_for(ready.exists), "the child never installed its SIGTERM handler"
    stop(proc, grace_s=10)
    assert proc.returncode == 0 and not marker.exists()  # the child was not sent SIGTERM ...
    assert wait_for(lambda: not child_alive()), "the server's child outlived stop()"  # ... nor outlived it


def test_handoff_breakdown_splits_the_first_gap_of_remote_requests():
    from bench.handoff import breakdown
    times = {"prefill_queued": 9.3, "prefill_started": 9.5, "prefill_done": 10.0, "transfer_started": 10.004,
             "transfer_done": 10.034, "decode_admitted": 10.035,
             "decode_started": 10.055}
    # each request's client start, then its tokens' arrivals
    remote = ([9.202, 10.002, 10.1, 10.14, 10.18], {"prefill_path": "remote", "times": times})
    local = ([19.6, 20.0, 20.04, 20.5], {"prefill_path": "local", "times": {}})
    out = breakdown([remote, local])
    assert out["requests"] == 2 and out["remote"] == 1
    parts = out["parts_ms"]
    assert parts["first_gap"]["median"] == 98.0 and parts["handover"]["median"] == 4.0
    assert parts["pull"]["median"] == 30.0 and parts["admission"]["median"] == 20.0
    assert parts["step_out"]["median"] == 45.0
    assert parts["prefill_wait"]["median"] == 200.0 and parts["prefill"]["median"] == 500.0
    assert out["ttft_median_ms"] == 600.0 and out["ttft_p99_ms"] == 800.0
    # gaps 98, 40, 40 (remote) and 40, 460 (local): the local prefill's stall stays without first gaps
    assert out["itl_median_ms"] == 40.0 and out["itl_p99_without_first_ms"] == 460.0


def test_compare_replot_draws_a_finished_runs_plots_and_runs_nothing(tmp_path, monkeypatch):
    from bench import compare

    drawn = []
    monkeypatch.setattr(compare, "plots", lambda results, out: drawn.append((results, out)))
    monkeypatch.setattr(compare, "case_a", lambda cfg: pytest.fail("--replot must not run a case"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "compare.json").write_text(json.dumps({"seed": 1, "cases": {"a": []}}))
    assert compare.main(["--replot", str(run), "--result-dir", str(tmp_path / "results")]) == 0
    assert drawn == [({"seed": 1, "cases": {"a": []}}, run)]
    assert not (tmp_path / "results").exists()  # no new result directory
