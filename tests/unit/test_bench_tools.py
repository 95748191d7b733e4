"""The tool-calling bench phase's maths and report, from made-up results (no stack): the arms'
payloads, the ratios per token against free text, answers that are not calls counted as
failures, the targets judged against the 0.90 bar, and the chat stream's client."""
from __future__ import annotations

import json

from bench.bench import parse_args
from bench.loadgen import Inflight, RequestResult
from bench.tools import (ITEMS, chat_payload, format_lines, ratios, send_chat, summarize_arm,
                         tool, tools_targets)

from .factories import FakeStream


def results(n: int, tokens: int, wall: float, finish: str, max_tokens: int = 256) -> list:
    return [RequestResult(start=0.0, first_token=0.1, end=wall, status="succeeded",
                          completion_tokens=tokens, expected_tokens=max_tokens,
                          finish_reason=finish) for _ in range(n)]


def phase(free_tps: float, named_tps: float, required_tps: float, length: int = 50) -> dict:
    runs = {arm: summarize_arm(arm, results(10, length, 10 * length / tps,
                                            "length" if arm == "free" else "tool_calls",
                                            length if arm == "free" else 256), 10 * length / tps,
                               False)
            for arm, tps in (("free", free_tps), ("named", named_tps),
                             ("required", required_tps))}
    return {"concurrency": 64, "length": length, **runs, **ratios(runs)}


def test_the_arms_answers_are_the_same_length():
    free = chat_payload("Hi", "free", 50)
    assert (free["max_tokens"], free["min_tokens"], free["ignore_eos"]) == (50, 50, True)
    assert "tools" not in free
    named = chat_payload("Hi", "named", 256)
    assert named["tool_choice"] == {"type": "function", "function": {"name": "record_readings"}}
    assert [t["function"]["name"] for t in named["tools"]] == ["record_readings"]
    assert named["parallel_tool_calls"] is False and "ignore_eos" not in named
    required = chat_payload("Hi", "required", 256)
    assert required["tool_choice"] == "required" and len(required["tools"]) == 2
    readings = tool("x")["function"]["parameters"]["properties"]["readings"]
    assert readings["minItems"] == readings["maxItems"] == ITEMS


def test_ratios_are_tool_rates_over_free_text():
    r = phase(1000.0, 950.0, 800.0)
    assert r["free"]["tokens_per_s"] == 1000.0
    assert (r["named_ratio"], r["required_ratio"]) == (0.95, 0.8)
    targets = tools_targets(r)
    assert [t["met"] for t in targets] == [True, False]
    assert all("0.9" in t["name"] for t in targets)
    lines = "\n".join(format_lines(r))
    assert "0.95 of free" in lines and "0.80 of free" in lines


def test_a_tool_answer_shorter_than_max_tokens_counts_and_text_fails():
    rs = results(3, 50, 1.0, "tool_calls") + results(1, 50, 1.0, "stop")
    s = summarize_arm("named", rs, 1.0, False)
    assert (s["ok"], s["failures"]) == (3, 1)
    assert s["completion_tokens"] == 150 and s["mean_completion_tokens"] == 50
    assert "not a tool call" in s["failure_examples"][0]


def test_a_failed_warm_up_reports_no_target():
    r = {"concurrency": 64, "error": "the warm-up call failed"}
    assert tools_targets(r) == [] and "warm-up" in format_lines(r)[0]
    assert tools_targets(None) == []


def test_only_tools_is_a_phase():
    assert parse_args(["--only", "tools"]).only == "tools"
    assert parse_args(["--skip-tools"]).skip_tools


class _Session:
    def __init__(self, chunks, headers):
        self.chunks, self.headers, self.sent = chunks, headers, []

    def post(self, url, json=None, **kw):
        self.sent.append(url)
        return FakeStream(self.chunks, self.headers)


def _delta(delta, finish=None) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def test_a_held_chat_stream_is_read_and_cancellable_by_its_id():
    """The chat route's deltas are token events (a call's too), the finish reason is kept,
    and llmq's id is in flight while the stream is open (the watchdog cancels by it: an
    answer with tools sends nothing until its end)."""
    inflight, seen = Inflight(), []
    chunks = [_delta({"role": "assistant", "content": ""}),
              _delta({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}),
              _delta({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                     "tool_calls"),
              f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 9}})}\n\n"
              .encode(), b"data: [DONE]\n\n"]
    session = _Session(chunks, {"X-Request-Id": "seq-1"})
    add = inflight.add
    inflight.add = lambda seq_id: (add(seq_id), seen.append(set(inflight.ids)))
    r = send_chat(session, "http://x", chat_payload("Hi", "named", 256), inflight=inflight)
    assert session.sent == ["http://x/v1/chat/completions"]
    assert r.status == "succeeded" and r.finish_reason == "tool_calls"
    assert r.completion_tokens == 9 and len(r.token_times) == 2
    assert seen == [{"seq-1"}] and inflight.ids == set()   # added, then discarded


def test_each_arm_leads_a_round_in_turn_and_is_its_median_round():
    from bench.tools import ARMS, median_round, rotated

    assert [rotated(ARMS, r)[0] for r in range(len(ARMS))] == list(ARMS)
    assert sorted(rotated(ARMS, 1)) == sorted(ARMS)
    rounds = [{"tokens_per_s": 250.0, "failures": 0}, {"tokens_per_s": 300.0, "failures": 1},
              {"tokens_per_s": 200.0, "failures": 0}]
    med = median_round(rounds)
    assert med["tokens_per_s"] == 250.0 and med["rounds_tokens_per_s"] == [250.0, 300.0, 200.0]
    assert med["failures"] == 1   # a failure in any round counts
    assert median_round(rounds[:2])["tokens_per_s"] == 250.0   # even: the lower middle
