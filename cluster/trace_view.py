"""`tandem trace`: a recent request's stage timelines (GET /admin/requests/{id}/trace) as readable tables."""
from __future__ import annotations


def format_trace(trace: dict) -> str:
    """One table per timeline (per prompt, or per candidate run alone): each stage the request passed, its
    time since arrival and since the stage before; then the routing decision and the KV transfer."""
    timelines = trace["timelines"]
    lines = [f"request {trace['request_id']}: {len(timelines)} timeline{'s' if len(timelines) != 1 else ''}"]
    for i, t in enumerate(timelines):
        lines += ["", f"timeline {i}:"] if len(timelines) > 1 else [""]
        rows, previous = [["STAGE", "SINCE ARRIVAL", "STEP"]], 0.0
        for stage, since in t["stages"].items():
            rows.append([stage, _ms(since), "" if stage == "arrival" else "+" + _ms(since - previous)])
            previous = since
        lines += _table(rows)
        lines += ["", _route(t), _transfer(t)]
        if t["phases"]:
            lines.append("phases: " + ", ".join(f"{name} {_ms(s)}" for name, s in t["phases"].items()))
    return "\n".join(lines)


def _route(t: dict) -> str:
    where = t.get("prefill_path") or "-"
    prefill = f"prefill {t['prefill_worker']} ({t['prefill_overlap_blocks']} blocks cached)" \
        if t.get("prefill_worker") else "prefill on the decode worker"
    predicted = f", predicted TTFT {_ms(t['predicted_ttft_s'])}" if t.get("predicted_ttft_s") is not None else ""
    return (f"routed: {where} ({t.get('routing_reason') or '-'}){predicted}; {prefill}; "
            f"decode {t.get('decode_worker') or '-'} ({t['decode_overlap_blocks']} blocks cached)")


def _transfer(t: dict) -> str:
    if not t["blocks_pulled"] and not t["blocks_skipped"]:
        return "KV transfer: none"
    return (f"KV transfer: {t['blocks_pulled']} blocks ({t['bytes_pulled']:,} bytes) pulled, "
            f"{t['blocks_skipped']} skipped (cached on decode)")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
