"""A page of GET /v1/jobs is bounded in bytes as well as in jobs (LLMQ_LIST_PAGE_BYTES, issue
48): `limit=100` over logprobs-heavy jobs built GBs in the API process. A page stops before
the job that would take it past the bound, with has_more and its last id to go on from, and
reads whole only the jobs it returns."""
from __future__ import annotations

from common.protocol import FinishReason

from .test_api_unit import Api, auth

TEXT = 100_000   # each job's text: ~400 kB as its end counts it (record, events, done event)


def jobs_of(api: Api, n: int, texts: list[int] | None = None) -> list[str]:
    """n ended jobs of k1, newest last."""
    ids = []
    for i in range(n):
        resp = api.client.post("/v1/jobs", json={"prompt": "x", "max_tokens": 1},
                               headers=auth("k1"))
        seq_id = resp.get_json()["id"]
        api.store.finish(seq_id, FinishReason.STOP, text="y" * (texts[i] if texts else TEXT),
                         completion_tokens=1)
        ids.append(seq_id)
    return ids


def all_pages(api: Api, monkeypatch) -> list[tuple[dict, list[str]]]:
    """Every page of k1's list (limit 100), each with the ids it read whole."""
    loaded: list[str] = []
    get_records = api.store.get_records
    monkeypatch.setattr(api.store, "get_records", lambda seq_ids: (
        loaded.extend(seq_ids), get_records(seq_ids))[1])
    pages, after = [], None
    while True:
        loaded.clear()
        resp = api.client.get("/v1/jobs", headers=auth("k1"), query_string={
            "limit": 100, **({"after": after} if after else {})})
        assert resp.status_code == 200, resp.get_json()
        page = resp.get_json()
        pages.append((page, list(loaded)))
        if not page["has_more"]:
            return pages
        after = page["last_id"]


def test_a_page_stops_at_its_bytes_and_the_next_goes_on_from_its_last_job(monkeypatch):
    api = Api(api_keys=("k1",), list_page_bytes=900_000)
    ids = jobs_of(api, 7)
    pages = all_pages(api, monkeypatch)
    listed = [j["id"] for page, _ in pages for j in page["data"]]
    assert listed == ids[::-1]   # each once, newest first
    assert [len(page["data"]) for page, _ in pages] == [2, 2, 2, 1]
    for page, loaded in pages:
        assert page["last_id"] == page["data"][-1]["id"]
        assert len(loaded) == len(page["data"])   # what a page does not return, it never read


def test_a_job_bigger_than_a_page_comes_alone():
    api = Api(api_keys=("k1",), list_page_bytes=50_000)
    ids = jobs_of(api, 3, texts=[10, TEXT, 10])
    first = api.client.get("/v1/jobs?limit=100", headers=auth("k1")).get_json()
    assert [j["id"] for j in first["data"]] == [ids[2]] and first["has_more"]
    second = api.client.get(f"/v1/jobs?limit=100&after={first['last_id']}",
                            headers=auth("k1")).get_json()
    assert [j["id"] for j in second["data"]] == [ids[1]] and second["has_more"]
    assert len(second["data"][0]["text"]) == TEXT


def test_small_jobs_fill_a_page_to_its_limit():
    api = Api(api_keys=("k1",))
    ids = jobs_of(api, 5, texts=[10] * 5)
    page = api.client.get("/v1/jobs?limit=3", headers=auth("k1")).get_json()
    assert [j["id"] for j in page["data"]] == ids[:1:-1] and page["has_more"]
