"""A sequence's logprobs are kept once in Redis: in its token events, which every reader of
the final job (GET, listings, webhooks, batch lines, the done event the API relays) gathers
them from; in the record only where no event carries them whole (an echo without tokens, a
stream trimmed to LLMQ_STREAM_MAXLEN). Engine over a scripted backend, a real redis-server."""
from __future__ import annotations

import json

from common.keys import Keys
from common.llm_engine import LLMEngine
from common.protocol import (EVENT_DONE, EVENT_RESET, EVENT_TOKEN, SamplingParams,
                             SequenceRequest)
from common.store import SequenceStore, events_key, record_key
from common.store.events import IN_EVENTS, gather_logprobs

from .factories import LogprobsBackend, Settings, make_engine

PROMPT = [3, 4, 5, 6]


def run_job(store, seq_ids=("s",), **params) -> list:
    """Submits and runs sequences to their ends with the scripted logprobs backend."""
    store.create([SequenceRequest(seq_id=s, prompt_token_ids=PROMPT,
                                  params=SamplingParams(**params)) for s in seq_ids])
    engine = make_engine(store, LogprobsBackend())
    seqs = [engine.admit(s) for s in seq_ids]
    for _ in range(200):
        if all(s.done.is_set() for s in seqs) and not engine.output.has_pending:
            return seqs
        engine.step()
    raise AssertionError("not finished")


def raw_events(r, seq_id: str) -> list[tuple[str, dict]]:
    return [(f["event"], json.loads(f["data"])) for _id, f in r.xrange(events_key(seq_id))]


def done_as_the_api_relays_it(store, seq_id: str, after: str = "0-0") -> dict:
    *_, (_id, kind, data) = list(LLMEngine(Settings(), store, celery=None).events(seq_id, after))
    assert kind == EVENT_DONE
    return data


def test_logprobs_live_in_the_token_events_only_and_every_reader_gets_them(redis_client):
    store = SequenceStore(redis_client)
    seqs = run_job(store, ("a", "b"), max_tokens=6, ignore_eos=True, logprobs=3,
                   prompt_logprobs=2)
    for seq in seqs:
        rec = redis_client.hgetall(record_key(seq.seq_id))
        # the record and the done event hold none of them ...
        assert rec["logprobs"] == rec["prompt_logprobs"] == IN_EVENTS
        events = raw_events(redis_client, seq.seq_id)
        [done] = [d for k, d in events if k == EVENT_DONE]
        assert "logprobs" not in done and "prompt_logprobs" not in done
        # ... each token event its own entry, the first the prompt's as well
        tokens = [d for k, d in events if k == EVENT_TOKEN]
        assert [len(d["logprobs"]) for d in tokens] == [1] * 6
        assert "prompt_logprobs" in tokens[0] and all("prompt_logprobs" not in d
                                                       for d in tokens[1:])
        # and a reader of the job gets them whole, as the sequence made them
        job = store.get_job(seq.seq_id)
        assert job["logprobs"] == seq.logprobs and len(job["logprobs"]) == 6
        assert job["prompt_logprobs"] == seq.prompt_logprobs and len(job["prompt_logprobs"]) == 4
        assert all(len(e["top_logprobs"]) == 3 for e in job["logprobs"])
        # the done event the API relays is the job, logprobs and all, from the start or resumed
        assert done_as_the_api_relays_it(store, seq.seq_id) == job
        last_token_id = redis_client.xrange(events_key(seq.seq_id))[-2][0]
        assert done_as_the_api_relays_it(store, seq.seq_id, last_token_id) == job


def test_a_job_without_logprobs_reads_no_more_than_before(redis_client):
    store = SequenceStore(redis_client)
    run_job(store, max_tokens=3, ignore_eos=True)
    rec = redis_client.hgetall(record_key("s"))
    assert "logprobs" not in rec and "prompt_logprobs" not in rec
    job = store.get_job("s")
    assert "logprobs" not in job and done_as_the_api_relays_it(store, "s") == job


def test_an_echo_without_tokens_keeps_its_prompt_logprobs_in_the_record(redis_client):
    store = SequenceStore(redis_client)
    [seq] = run_job(store, max_tokens=0, prompt_logprobs=1, logprobs=1)
    rec = redis_client.hgetall(record_key("s"))
    assert json.loads(rec["prompt_logprobs"]) == seq.prompt_logprobs
    job = store.get_job("s")
    assert job["prompt_logprobs"] == seq.prompt_logprobs and job["logprobs"] == []
    assert done_as_the_api_relays_it(store, "s") == job


def test_a_stream_trimmed_to_its_maxlen_leaves_the_logprobs_in_the_record(redis_client):
    store = SequenceStore(redis_client, stream_maxlen=4)
    [seq] = run_job(store, max_tokens=8, ignore_eos=True, logprobs=1)
    rec = redis_client.hgetall(record_key("s"))
    assert json.loads(rec["logprobs"]) == seq.logprobs
    assert store.get_job("s")["logprobs"] == seq.logprobs and len(seq.logprobs) == 8


def test_gathered_logprobs_are_the_last_runs():
    def tok(n):
        return EVENT_TOKEN, {"text": "", "logprobs": [{"n": n}]}
    first = (EVENT_TOKEN, {"text": "", "logprobs": [{"n": 0}], "prompt_logprobs": [{"p": 0}]})
    again = (EVENT_TOKEN, {"text": "", "logprobs": [{"n": 10}], "prompt_logprobs": [{"p": 1}]})
    entries = [first, tok(1), (EVENT_RESET, {"attempt": 2}), again, tok(11),
               (EVENT_DONE, {})]
    assert gather_logprobs(entries) == {"logprobs": [{"n": 10}, {"n": 11}],
                                        "prompt_logprobs": [{"p": 1}]}


def test_the_records_of_a_logprobs_job_are_small(redis_client):
    """n=8, 20 alternatives, 32 tokens: the record is a few KB, the events hold the entries
    once (before, each entry was kept in the events, the record and the done event)."""
    store = SequenceStore(redis_client)
    ids = [f"s{i}" for i in range(8)]
    run_job(store, ids, max_tokens=32, ignore_eos=True, logprobs=20)
    kept = 0
    for s in ids:
        entries = len(json.dumps(store.get_job(s)["logprobs"]))
        assert redis_client.memory_usage(record_key(s)) < entries / 4
        assert redis_client.memory_usage(events_key(s)) < 1.5 * entries
        kept += redis_client.memory_usage(record_key(s)) + redis_client.memory_usage(events_key(s))
    # and the storage quota counts about what Redis keeps (the owner: "", a keyless server)
    counted = int(redis_client.get(Keys.owner_stored_bytes("")))
    assert 0.8 * kept < counted < 1.25 * kept
