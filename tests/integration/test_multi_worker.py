"""Scale-out: two workers that share nothing but the Redis URL split a burst by free capacity."""
import pytest
import redis
import requests

from common.settings import Settings
from common.store import record_key
from support import (ApiServer, RedisServer, WorkerProcess, backend_params, backend_worker,
                     min_step_env, stop_workers, wait_until)


@pytest.fixture(params=backend_params())
def two_worker_stack(request, tmp_path):
    server = RedisServer(tmp_path).start()
    model, env = backend_worker(request.param, request)
    # 16 slots each: a burst of 48 must spill over to the second worker, whoever is first.
    # Two workers on one host get a core each, as they would be run (llama.cpp's threads
    # spin: two workers with a thread per core each ran this burst ~8x slower).
    # Steps of at least 50 ms: a round of 12 tokens lasts >= 0.6 s, time enough for the second
    # worker to take its share however fast the first one runs.
    env = {**env, **min_step_env(0.05), "LLMQ_MAX_NUM_SEQS": "16", "LLMQ_TORCH_THREADS": "1"}
    workers = [WorkerProcess(server.url, model, tmp_path / f"w{i}.log", name=f"mw{i}",
                             extra_env=env) for i in range(2)]
    api = None
    try:
        for w in workers:
            w.start(wait_ready=False)
        for w in workers:
            w.wait_ready()
        api = ApiServer(Settings.from_env(redis_url=server.url, model=model)).start()
        yield {"url": api.url, "redis": server, "workers": workers}
    finally:
        if api:
            api.stop()
        stop_workers(workers)
        server.stop()


@pytest.mark.slow
def test_burst_spreads_over_both_workers_and_runs_each_sequence_once(two_worker_stack):
    url = two_worker_stack["url"]
    r = redis.Redis.from_url(two_worker_stack["redis"].url, decode_responses=True)
    prompts = [f"prompt number {i}" for i in range(48)]
    jobs = requests.post(f"{url}/v1/jobs", json={"prompts": prompts, "max_tokens": 12,
                                                 "ignore_eos": True, "temperature": 0},
                         timeout=30).json()["jobs"]
    ids = [j["id"] for j in jobs]

    def all_done():
        return all(r.hget(record_key(i), "status") == "succeeded" for i in ids)

    wait_until(all_done, 240, "the burst to finish")
    ran_on = [r.hget(record_key(i), "worker") for i in ids]
    names = {w.hostname for w in two_worker_stack["workers"]}
    assert set(ran_on) == names, f"both workers must take part: {sorted(set(ran_on))}"
    # None ran twice: one start per sequence, one done event per stream.
    assert all(r.hget(record_key(i), "attempts") == "1" for i in ids)
    for i in ids:
        events = r.xrange(record_key(i) + ":events")
        assert sum(1 for _eid, f in events if f["event"] == "done") == 1
        assert r.hget(record_key(i), "completion_tokens") == "12"
