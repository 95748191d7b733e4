"""Logprobs in OpenAI's two shapes, from the entries the worker keeps per token
({"token_id", "token", "logprob", "rank", "top_logprobs": [...]}, see worker/logprobs.py).

Completions use the legacy shape: parallel lists `tokens`, `token_logprobs`, `top_logprobs`
(a {token: logprob} dict per token: the k most likely plus the sampled one, as vLLM gives) and
`text_offset` (each token's start in the text). Chat uses `{"content": [{"token", "logprob",
"bytes", "top_logprobs": [...]}]}`. Both are built the same way streamed (a piece per chunk)
and not, so the numbers agree.
"""
from __future__ import annotations


def token_text(entry: dict, as_ids: bool = False) -> str:
    """vLLM's return_tokens_as_token_ids writes "token_id:<id>" instead of the text."""
    return f"token_id:{entry['token_id']}" if as_ids else entry["token"]


class LegacyLogprobs:
    """Builds completions' logprobs objects, keeping the text offset across stream chunks."""

    def __init__(self, as_ids: bool = False):
        self.as_ids = as_ids
        self.offset = 0

    def __call__(self, entries: list[dict]) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for e in entries:
            tok = token_text(e, self.as_ids)
            out["tokens"].append(tok)
            out["text_offset"].append(self.offset)
            self.offset += len(e["token"])
            out["token_logprobs"].append(e["logprob"])
            if e["logprob"] is None:   # a prompt's first token: nothing predicts it
                out["top_logprobs"].append(None)
                continue
            top = {token_text(t, self.as_ids): t["logprob"] for t in e["top_logprobs"]}
            top.setdefault(tok, e["logprob"])
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(entries: list[dict], as_ids: bool = False) -> dict:
    def item(e: dict) -> dict:
        tok = token_text(e, as_ids)
        return {"token": tok, "logprob": e["logprob"], "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top_logprobs"]]}
                        for e in entries]}
