"""Webhook deliveries cannot stall generation (issue 48): they run on their own queue and pool,
the delivery worker's, so a receiver that accepts and never answers holds none of the task
threads another key's sequences need, and holds at most its host's cap of the delivery pool.

Real redis-server, a real generation worker with two task threads, a real delivery worker, the
real HTTP app, and a loopback receiver that never answers (every delivery to it lasts the whole
LLMQ_WEBHOOK_TIMEOUT, five minutes here)."""
from __future__ import annotations

import pytest

from reliability.factories import World
from support import wait_until
from webhook_receiver import SilentReceiver, new_secret

pytestmark = pytest.mark.integration

KEYS = ("key-a", "key-b")
SECRET = new_secret()
HOOKS = {"LLMQ_WEBHOOK_SECRET": SECRET, "LLMQ_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
         "LLMQ_WEBHOOK_TIMEOUT": "300", "LLMQ_WEBHOOK_MAX_PER_HOST": "2"}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    w = World(tmp_path_factory.mktemp("webhook-isolation"), tiny_model_dir)
    try:
        w.start_redis()
        # Two task threads: two deliveries holding them would stop generation dead.
        w.worker("w1", LLMQ_MAX_NUM_SEQS="2", LLMQ_TASK_THREADS="2", **HOOKS)
        # (not waited for: deliveries wait in their queue until it is up)
        w.delivery_worker("d1", wait=False, LLMQ_WEBHOOK_THREADS="6", **HOOKS)
        yield w
    finally:
        w.close()


def test_a_receiver_that_never_answers_does_not_delay_another_keys_generation(world):
    api = world.api(api_keys=KEYS, webhook_secret=SECRET, webhook_allowed_hosts=("127.0.0.1",),
                    webhook_timeout_s=300.0)
    a, b = api.with_key(KEYS[0]), api.with_key(KEYS[1])
    silent = SilentReceiver()
    try:
        jobs = [a.submit(prompt=f"hook {i}", max_tokens=2, webhook=silent.url + "/in",
                         webhook_events=["started", "completed"]) for i in range(4)]
        for job in jobs:
            assert a.wait_job(job["id"], timeout_s=120)["status"] == "succeeded"
        wait_until(lambda: silent.connections >= 2, 120,
                   "two deliveries hanging on the silent receiver")
        # While they hang, another key's request runs at once.
        mine = b.submit(prompt="mine", max_tokens=4)
        assert b.wait_job(mine["id"], timeout_s=60)["status"] == "succeeded"
        # Eight deliveries to a host capped at two in flight: two hang, the others are held
        # back (queued again for later, not an attempt) instead of taking more threads.
        log = world.workers[1].log_path
        wait_until(lambda: "held back" in log.read_text(), 60, "deliveries held back")
        assert silent.connections == 2        # the host's cap, with six threads to take
        assert "Task llmq.webhook[" not in world.workers[0].log_path.read_text()
    finally:
        silent.stop()
