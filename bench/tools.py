"""The cost of tool calling, served (`--only tools`, issue 49): the same closed-loop chat workload
at one concurrency three times on /v1/chat/completions, in one run: free text, then every
request with a named tool_choice, then every request with two tools and tool_choice
"required". Tool calls decode under the grammar built from the tools' schemas, so the
difference is what that grammar costs the served rate.

The answers are the same length in every arm: the tools' one argument is an array of exactly
ITEMS one-digit integers (the grammar closes the call after it, whatever the model wants), and
the free arm asks, with ignore_eos, for the tokens an untimed named call took. The ratios are
per generated token (completion tokens over the run's wall time), against the bar of 0.90.
"""
from __future__ import annotations

import functools
import statistics

from . import report
from .loadgen import closed_loop, stream_completion
from .raw import short_prompts

BAR = 0.90
ITEMS = 24   # ~96 tokens an answer with the default model's tokenizer
ARMS = ("free", "named", "required")
send_chat = functools.partial(stream_completion, path="/v1/chat/completions")


def tool(name: str, items: int = ITEMS) -> dict:
    """A function tool whose arguments have a fixed length: `items` digits."""
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": items, "maxItems": items}
    return {"type": "function", "function": {
        "name": name, "description": f"Records {items} one-digit readings.",
        "parameters": {"type": "object", "properties": {"readings": digits},
                       "required": ["readings"], "additionalProperties": False}}}


def chat_payload(prompt: str, arm: str, max_tokens: int, items: int = ITEMS) -> dict:
    """One streamed greedy chat request of the arm: free text of exactly max_tokens tokens, or
    one call (max_tokens only a ceiling) of a named tool or of either of two tools."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0,
            "max_tokens": max_tokens}
    if arm == "free":
        return {**body, "min_tokens": max_tokens, "ignore_eos": True}
    tools = [tool("record_readings", items)] + ([tool("log_readings", items)]
                                                if arm == "required" else [])
    choice = ({"type": "function", "function": {"name": "record_readings"}} if arm == "named"
              else "required")
    return {**body, "tools": tools, "tool_choice": choice, "parallel_tool_calls": False}


def tools_phase(url: str, concurrency: int, num_requests: int, time_limit_s: float,
                progress=print, prompt_offset: int = 3000, ceiling: int = 256,
                items: int = ITEMS, rounds: int = 3) -> dict:
    """Runs the three arms `rounds` times, in turn, each round starting with another arm (a
    shared VM's speed drifts by 10-15 % between minutes: arms run once each in a fixed order
    compare the minutes more than the arms); each arm is its median round. Returns their
    summaries, the answers' lengths and the ratios."""
    prompts = short_prompts(num_requests, prompt_offset)
    # Untimed: the worker builds its grammar tokenizer at the first structured request (~1 s),
    # and the named call's length sets the free arm's.
    warm, _, _ = closed_loop(url, 1, [chat_payload(prompts[0], "named", ceiling, items)],
                             time_limit_s / 2, time_limit_s, send=send_chat)
    length = warm[0].completion_tokens if warm and warm[0].finish_reason == "tool_calls" else 0
    if not length:
        why = warm[0].describe_failure() if warm else "no answer"
        return {"concurrency": concurrency, "error": f"the warm-up call failed: {why} "
                                                     f"(finish {warm[0].finish_reason if warm else None})"}
    rounds_of: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        prompts = short_prompts(num_requests, prompt_offset + (r + 1) * num_requests)
        for arm in rotated(ARMS, r):
            payloads = [chat_payload(p, arm, length if arm == "free" else ceiling, items)
                        for p in prompts]
            results, wall, truncated = closed_loop(url, concurrency, payloads, time_limit_s / 2,
                                                   time_limit_s, send=send_chat)
            s = summarize_arm(arm, results, wall, truncated)
            rounds_of[arm].append(s)
            progress(f"tools: round {r + 1}/{rounds} concurrency {concurrency}, {arm}: "
                     f"{s['tokens_per_s']} tok/s, {s['mean_completion_tokens']} tokens/answer, "
                     f"{s['failures']} failed{' (cut by the time limit)' if truncated else ''}")
    runs = {arm: median_round(rounds_of[arm]) for arm in ARMS}
    return {"concurrency": concurrency, "length": length, "rounds": rounds, **runs,
            **ratios(runs)}


def rotated(arms: tuple | list, r: int) -> list:
    """The arms in round r's order: each arm goes first in turn."""
    k = r % len(arms)
    return list(arms[k:]) + list(arms[:k])


def median_round(summaries: list[dict]) -> dict:
    """An arm's round of median tokens/s (the lower middle of an even count), with every
    round's rate and the failures of all."""
    rated = sorted(summaries, key=lambda s: s.get("tokens_per_s") or 0)
    out = dict(rated[(len(rated) - 1) // 2])
    out["rounds_tokens_per_s"] = [s.get("tokens_per_s") for s in summaries]
    out["failures"] = sum(s.get("failures") or 0 for s in summaries)
    return out


def summarize_arm(arm: str, results: list, wall: float, truncated: bool) -> dict:
    """report.summarize over one arm. A tool answer's length is the grammar's, not max_tokens
    (only a ceiling), and an answer that is not a call is a failure."""
    if arm != "free":
        for r in results:
            r.expected_tokens = 0
            if r.error is None and r.status == "succeeded" and r.finish_reason != "tool_calls":
                r.error = f"finish_reason {r.finish_reason!r}, not a tool call"
    s = report.summarize(results, wall)
    ok = [r.completion_tokens for r in results if r.ok]
    s.update(truncated=truncated,
             mean_completion_tokens=round(statistics.fmean(ok), 1) if ok else None)
    return s


def ratios(runs: dict) -> dict:
    """Each tool arm's tokens/s over the free arm's."""
    free = runs["free"].get("tokens_per_s")
    out = {}
    for arm in ARMS[1:]:
        v = runs[arm].get("tokens_per_s")
        out[f"{arm}_ratio"] = round(v / free, 3) if free and v else None
    return out


def tools_targets(result: dict | None) -> list[dict]:
    """Issue 49's bar: structured tool-call decoding within 10 % of free text's rate."""
    if not result or "free" not in result:
        return []
    note = (f"c={result['concurrency']}, {result['length']} tokens per answer, free "
            f"{result['free']['tokens_per_s']} tok/s")
    return [{"name": f"tools: tool_choice {what} tok/s >= {BAR} x free text's (issue 49)",
             "value": result[f"{arm}_ratio"],
             "met": None if result[f"{arm}_ratio"] is None else result[f"{arm}_ratio"] >= BAR,
             "note": note}
            for arm, what in (("named", "named"), ("required", "required, two tools"))]


def format_lines(result: dict | None) -> list[str]:
    """The phase's lines of the summary."""
    if not result:
        return []
    if "error" in result:
        return [f"Tool calls at concurrency {result['concurrency']}: {result['error']}", ""]
    f = report._f
    lines = [f"Tool calls at concurrency {result['concurrency']} (/v1/chat/completions, "
             f"{result['length']} tokens per answer, greedy)"]
    for arm in ARMS:
        s = result[arm]
        ratio = (f": {f(result[f'{arm}_ratio'], '{:.2f}')} of free (bar {BAR})"
                 if arm != "free" else "")
        lines.append(f"  {arm:<8} {f(s['tokens_per_s'])} tok/s, {s['mean_completion_tokens']} "
                     f"tokens/answer, {s['failures']} failed{ratio}")
    return lines + [""]
