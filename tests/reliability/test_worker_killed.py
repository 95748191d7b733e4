"""A Celery worker and its model process die together (SIGKILL): nothing accepted is lost.

Two ways back: the same worker name starts again (it takes back its own leftovers at start),
or another live worker notices the silent heartbeat after LLMQ_WORKER_STALE and takes them.
Either way every sequence ends succeeded exactly once, and a restarted one shows its readers a
`reset` event after which the token texts add up to the final text.
"""
from __future__ import annotations

import json

import pytest
from kombu import Connection

from common.celery_config import celery_config
from common.settings import Settings
from common.store import SequenceStore, WORKERS_KEY, running_key
from support import wait_until

from .factories import (HEARTBEAT_S, SLACK_S, STALE_S, assert_all_succeeded_once, kill_hard,
                        record, running_with_tokens, statuses, stream_kinds)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

N = 10
MAX_TOKENS = 60
PARAMS = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
# Each engine step lasts at least this long: a sequence seen running with 5 tokens still has
# >= 2.75 s to go when the test kills its worker, on any machine.
MIN_STEP_S = 0.05


def _submit(api) -> list[str]:
    return [j["id"] for j in api.submit_many([f"Story number {i}:" for i in range(N)], **PARAMS)]


def _unacked_task_ids(r) -> set[str]:
    """Task ids of the messages the broker holds as delivered but never acknowledged."""
    return {json.loads(v)[0]["headers"]["id"] for v in r.hvals("unacked")}


def _check_restarted(stream, final: dict, rec: dict) -> None:
    assert stream.kinds.count("reset") == 1, stream.kinds
    # Tokens of the lost attempt came before the reset; what follows it is the whole answer.
    assert stream.kinds.index("reset") > 0
    assert stream.texts_after_last_reset() == final["text"]
    assert rec["attempts"] == "2", rec


def _check_untouched(stream, final: dict, rec: dict) -> None:
    assert "reset" not in stream.kinds, stream.kinds
    assert stream.texts_after_last_reset() == final["text"]
    assert rec["attempts"] == "1", rec


def test_worker_killed_and_started_again_under_its_name_reruns_what_it_had(world):
    # 6 run at once, 4 wait in the broker
    w1 = world.worker("w1", min_step_s=MIN_STEP_S, LLMQ_MAX_NUM_SEQS="6")
    api, r = world.api(), world.client()
    store = SequenceStore(r)
    ids = _submit(api)
    readers = {i: api.stream(i) for i in ids}

    # Kill only when every message is accounted for in Redis: 6 started (running, tokens
    # flowing) and 4 still in the broker queue, so none is merely reserved by the worker.
    def six_running_four_queued():
        running = running_with_tokens(r, ids, 5)
        return running if len(running) == 6 and store.queue_depth("llmq") == 4 else None

    running = wait_until(six_running_four_queued, 90, "6 sequences running, 4 queued")
    kill_hard(w1)
    # A hard kill hands nothing back: the records still say running, under the dead name.
    assert statuses(r, running) == ["running"] * 6
    assert r.smembers(running_key(w1.hostname)) == set(running)
    # Its six messages, delivered and never acknowledged, as kombu would redeliver them after
    # the visibility timeout (kept here: once their sequences end, the reconciler may drop them
    # from `unacked` first, docs/reliability.md).
    dead = {tag: body for tag, body in r.hgetall("unacked").items()
            if json.loads(body)[0]["headers"]["id"] in running}
    assert len(dead) == 6

    world.worker("w1", LLMQ_MAX_NUM_SEQS="6")        # the same name comes back
    finals = assert_all_succeeded_once(api, r, ids, MAX_TOKENS)
    for seq_id in ids:
        stream = readers[seq_id].result()
        assert stream.done == finals[seq_id]
        check = _check_restarted if seq_id in running else _check_untouched
        check(stream, finals[seq_id], record(r, seq_id))

    # The dead worker's six Celery messages were never acknowledged: the broker would hand
    # them out again after the visibility timeout. Redeliver them now, the way kombu does, and
    # the start guard skips every one: nothing runs or finishes twice.
    wait_until(lambda: _unacked_task_ids(r) <= set(running), 30,
               "every message but the dead worker's to be acknowledged")
    r.hset("unacked", mapping=dead)   # (back where kombu's restore reads them)
    settings = Settings.from_env(redis_url=world.url)
    with Connection(world.url, transport_options=celery_config(settings)[
            "broker_transport_options"]) as conn:
        qos = conn.default_channel.qos
        for tag in dead:
            qos.restore_by_tag(tag)
    log = world.workers[-1].log_path
    wait_until(lambda: not r.hlen("unacked") and store.queue_depth("llmq") == 0
               and log.read_text().count("'skipped': True") == 6, 60,
               "the redelivered messages to be taken and skipped")
    for seq_id in ids:
        assert record(r, seq_id)["attempts"] == ("2" if seq_id in running else "1")
        assert stream_kinds(r, seq_id).count("done") == 1
        assert api.job(seq_id) == finals[seq_id]


def test_worker_killed_while_another_runs_is_reaped_after_the_stale_time(world):
    w1 = world.worker("w1", wait=False, min_step_s=MIN_STEP_S)
    w2 = world.worker("w2", wait=False, min_step_s=MIN_STEP_S)
    w1.wait_ready()
    w2.wait_ready()
    api, r = world.api(), world.client()
    ids = _submit(api)
    readers = {i: api.stream(i) for i in ids}

    # Both workers reserve what they can at once; kill when all ten have started.
    wait_until(lambda: len(running_with_tokens(r, ids, 5)) == N, 90, "all sequences running")
    owners = {i: record(r, i)["worker"] for i in ids}
    lost = [i for i, w in owners.items() if w == w1.hostname]
    assert lost and len(lost) < N, f"the test needs w1 and w2 each to run some: {owners}"
    kill_hard(w1)
    last_beat = r.zscore(WORKERS_KEY, w1.hostname)   # dead now: this beat was its last
    assert last_beat is not None

    finals = assert_all_succeeded_once(api, r, ids, MAX_TOKENS)
    for seq_id in ids:
        stream = readers[seq_id].result()
        assert stream.done == finals[seq_id]
        rec = record(r, seq_id)
        assert rec["worker"] == w2.hostname, rec    # w2 finished every one of them
        if seq_id in lost:
            _check_restarted(stream, finals[seq_id], rec)
            # Reaped only once the heartbeat was LLMQ_WORKER_STALE old, and not long after: w2
            # looks at every one of its own beats.
            reset_id = next(e.id for e in stream.events if e.event == "reset")
            reset_at = int(reset_id.split("-")[0]) / 1000
            waited = reset_at - last_beat
            assert STALE_S - 0.01 <= waited <= STALE_S + HEARTBEAT_S + SLACK_S, waited
        else:
            _check_untouched(stream, finals[seq_id], rec)
    # The dead worker is gone from the registry, and so is its list of running sequences.
    assert r.zscore(WORKERS_KEY, w1.hostname) is None
    assert not r.exists(running_key(w1.hostname))
