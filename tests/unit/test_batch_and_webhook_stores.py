"""The pieces under the Batch API and webhooks, on fakeredis: the SSRF guard (with a resolver
that lies, as DNS rebinding does), the Standard Webhooks signature (the spec's own test vector),
webhook events becoming due exactly when their job starts or ends, a batch line answered once,
the driver lease, and cursor pagination."""
from __future__ import annotations

import io
import json
import socket

import fakeredis
import pytest

from common.batch_store import BatchStore, line_seq_id, new_batch_id
from common.file_store import new_file_id
from common.owner_index import OwnerIndex, UnknownCursor, index_key
from common.reconcile_store import ReconcileStore
from common.settings import Settings
from common.store import record_key
from common.webhook_guard import WebhookUnresolvable, WebhookURLError, check_url
from common.webhook_store import WATCH_KEY, WebhookStore, registration_key



@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


def resolver(*addresses: str):
    def resolve(host, port, type=None):
        if not addresses:
            raise socket.gaierror("no such host")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]
    return resolve


# --- SSRF guard -------------------------------------------------------------------------------
def test_a_public_host_is_allowed_and_keeps_its_path_and_port():
    t = check_url("https://hooks.example.com:8443/in?x=1", resolve=resolver("93.184.216.34"))
    assert (t.scheme, t.host, t.port, t.path, t.addresses) == (
        "https", "hooks.example.com", 8443, "/in?x=1", ("93.184.216.34",))
    assert t.host_header == "hooks.example.com:8443"


def test_an_international_host_name_is_checked_and_sent_as_punycode():
    """The name stayed in Unicode: the Host header could not be encoded (the attempt failed
    outside the errors caught, and the event was lost) and DNS was asked in Unicode."""
    asked = []

    def resolve(host, port, type=None):
        asked.append(host)
        return resolver("93.184.216.34")(host, port, type)
    t = check_url("https://B\u00fccher.example:8443/in", resolve=resolve)
    assert asked == ["xn--bcher-kva.example"] and t.host_header == "xn--bcher-kva.example:8443"
    with pytest.raises(WebhookURLError, match="not a valid host name"):
        check_url("http://" + "\u00e9" * 70 + ".example/", resolve=resolve)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.0.0.5", "172.16.3.4", "192.168.1.1", "169.254.169.254", "100.64.0.1",
    "0.0.0.0", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "224.0.0.1",
    # IPv6 forms that a translator turns into a private IPv4 address, whatever this Python's
    # is_global says of them (it passed all but 6to4 on 3.11.7): NAT64, local-use NAT64,
    # 6to4, IPv4-compatible, IPv4-translated; and deprecated site-local
    "64:ff9b::a9fe:a9fe", "64:ff9b:1::a00:5", "2002:a9fe:a9fe::1", "::127.0.0.1",
    "::ffff:0:7f00:1", "fec0::1"])
def test_a_host_resolving_to_a_non_public_address_is_refused(address):
    with pytest.raises(WebhookURLError, match="public") as refused:
        check_url("http://hooks.example.com/", resolve=resolver(address))
    assert address in refused.value.detail
    with pytest.raises(WebhookURLError):
        check_url(f"http://[{address}]/" if ":" in address else f"http://{address}/")


@pytest.mark.parametrize("address", ["64:ff9b::808:808", "2002:808:808::1", "::ffff:0:808:808",
                                     "2606:4700:4700::1111"])
def test_ipv6_forms_of_public_addresses_pass(address):
    assert check_url("http://hooks.example.com/", resolve=resolver(address)).addresses == (
        address,)


def test_every_address_is_checked_not_just_the_first():
    with pytest.raises(WebhookURLError) as refused:
        check_url("http://hooks.example.com/", resolve=resolver("93.184.216.34", "10.0.0.1"))
    assert "10.0.0.1" in refused.value.detail


def test_the_refusal_tells_the_caller_nothing_of_what_a_name_resolves_to():
    """The message reaches any key (a 400 at submit, the job's webhook attempts): "does not
    resolve" against "resolves to 10.0.0.5" told it which internal names exist and where."""
    with pytest.raises(WebhookUnresolvable) as unknown:
        check_url("http://nosuch.internal/", resolve=resolver())
    with pytest.raises(WebhookURLError) as internal:
        check_url("http://redis.internal/", resolve=resolver("10.0.0.5"))
    assert (str(unknown.value).replace("nosuch", "redis") == str(internal.value)
            and "10.0.0.5" not in str(internal.value))


def test_an_allowed_host_may_be_private_and_nothing_else_is():
    allowed = ("127.0.0.1", "receiver.internal")
    assert check_url("http://receiver.internal/", allowed, resolve=resolver("10.0.0.9"))
    with pytest.raises(WebhookURLError):
        check_url("http://other.internal/", allowed, resolve=resolver("10.0.0.9"))


@pytest.mark.parametrize("url", ["ftp://example.com/", "http:///nohost", "not a url",
                                 "http://user:pw@example.com/", "http://example.com:99999/",
                                 "http://e.com/" + "x" * 3000])
def test_malformed_urls_are_refused(url):
    with pytest.raises(WebhookURLError):
        check_url(url, resolve=resolver("93.184.216.34"))


def test_an_unresolvable_host_is_told_apart_so_delivery_retries_it():
    with pytest.raises(WebhookUnresolvable):
        check_url("http://gone.example.com/", resolve=resolver())


# --- signature and secret -----------------------------------------------------------------------
def test_signature_matches_the_standard_webhooks_test_vector():
    from worker.webhooks import sign

    key = Settings(webhook_secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").webhook_key()
    assert sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330,
                b'{"test": 2432232314}') == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


@pytest.mark.parametrize("secret", ["s3cret", "whsec_not*base64", "whsec_c2hvcnQ=",
                                    "wh_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
def test_a_malformed_webhook_secret_stops_the_settings(secret):
    with pytest.raises(ValueError, match="LLMQ_WEBHOOK_SECRET"):
        Settings(webhook_secret=secret)


# --- job webhook events -------------------------------------------------------------------------
def test_job_events_become_due_when_the_job_starts_and_ends_and_are_sent_once(r):
    store = WebhookStore(r, 3600)
    r.hset(record_key("s1"), mapping={"status": "queued", "started_at": ""})
    store.register_jobs(["s1"], "http://h/", ["completed", "started"])
    assert store.due_job_events() == []
    r.hset(record_key("s1"), mapping={"status": "running", "started_at": "1.0"})
    assert store.due_job_events() == [("s1", "started", "http://h/")]
    assert store.due_job_events() == []          # dispatching: not handed out twice
    store.job_event_sent("s1", "started")
    r.hset(record_key("s1"), "status", "succeeded")
    assert store.due_job_events() == [("s1", "completed", "http://h/")]
    store.job_event_sent("s1", "completed")
    assert not r.exists(registration_key("s1")) and not r.sismember(WATCH_KEY, "s1")


def test_an_event_whose_dispatcher_died_is_due_again_later(r):
    store = WebhookStore(r, 3600)
    r.hset(record_key("s1"), mapping={"status": "succeeded", "started_at": "1.0"})
    store.register_jobs(["s1"], "http://h/", ["completed"])
    assert store.due_job_events() == [("s1", "completed", "http://h/")]
    assert store.due_job_events(redispatch_after_s=60) == []
    assert store.due_job_events(redispatch_after_s=-1) == [("s1", "completed", "http://h/")]


def test_a_job_cancelled_before_it_started_sends_completed_only(r):
    store = WebhookStore(r, 3600)
    r.hset(record_key("s1"), mapping={"status": "cancelled", "started_at": ""})
    store.register_jobs(["s1"], "http://h/", ["started", "completed"])
    assert store.due_job_events() == [("s1", "completed", "http://h/")]
    store.job_event_sent("s1", "completed")
    assert not r.sismember(WATCH_KEY, "s1")


@pytest.mark.parametrize("status", ["cancelled", "failed"])
def test_a_started_only_registration_of_a_job_that_ended_unstarted_leaves_the_watch_set(
        r, status):
    # Nothing of it can ever be due: kept, every worker's scan would read it until it expired.
    store = WebhookStore(r, 3600)
    r.hset(record_key("s1"), mapping={"status": "queued", "started_at": ""})
    r.hset(record_key("s2"), mapping={"status": "running", "started_at": "1.0"})
    store.register_jobs(["s1", "s2"], "http://h/", ["started"])
    assert store.due_job_events() == [("s2", "started", "http://h/")]
    assert r.smembers(WATCH_KEY) == {"s1", "s2"}   # s1 may start yet; s2's is being sent
    r.hset(record_key("s1"), "status", status)
    r.hset(record_key("s2"), "status", "succeeded")
    assert store.due_job_events() == []
    assert r.smembers(WATCH_KEY) == {"s2"} and not r.exists(registration_key("s1"))
    store.job_event_sent("s2", "started")
    assert r.smembers(WATCH_KEY) == set()


# --- batches ------------------------------------------------------------------------------------
def new_batch(store: BatchStore, lines: int = 3) -> str:
    batch_id = new_batch_id()
    store.create({"id": batch_id, "owner": "o", "status": "validating",
                  "endpoint": "/v1/completions", "input_file_id": new_file_id(),
                  "completion_window": "24h", "created_at": 1.0, "expires_at": 9e9},
                 ['{"custom_id": "a"}'] * lines, {})
    return batch_id


def test_a_line_is_answered_once_whatever_comes_later(r):
    store = BatchStore(r, 3600)
    b = new_batch(store)
    store.take_line(b, 0)
    assert store.answer(b, 0, True, {"n": 1})
    assert not store.answer(b, 0, True, {"n": 2})
    assert not store.answer(b, 0, False, {"n": 3})
    assert store.answered(b, "out") == ['{"n": 1}'] and store.answered(b, "err") == []
    assert store.inflight(b)[0] == set()
    assert store.get(b, "o")["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert store.get(b, "someone else") is None


def test_batch_usage_sums_each_lines_tokens_once(r):
    store = BatchStore(r, 3600)
    b = new_batch(store)
    used = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 2}}
    assert store.answer(b, 0, True, {"n": 1}, used)
    assert not store.answer(b, 0, True, {"n": 1}, used)   # a second answer adds nothing
    assert store.answer(b, 1, False, {"n": 2}, {"prompt_tokens": 3, "completion_tokens": 1})
    assert store.answer(b, 2, False, {"n": 3})             # no sequence, no tokens
    assert store.get(b, "o")["usage"] == {
        "input_tokens": 8, "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 16}


def test_the_lease_has_one_holder_until_it_runs_out(r):
    store = BatchStore(r, 3600)
    b = new_batch(store)
    assert store.due() == [b]
    assert store.claim(b, "t1", 60)
    assert not store.claim(b, "t2", 60)          # dispatched and not yet run out
    assert store.renew(b, "t1", 15) and not store.renew(b, "t2", 15)
    assert store.due() == []
    assert store.renew(b, "t1", 0)               # handed back: due at once
    assert store.due() == [b] and store.claim(b, "t2", 60)
    assert not store.renew(b, "t1", 15)          # the old driver stops


def test_line_sequence_ids_are_stable_and_distinct():
    assert line_seq_id("batch_1", 0) == line_seq_id("batch_1", 0)
    assert len({line_seq_id("batch_1", i) for i in range(100)} |
               {line_seq_id("batch_2", 0)}) == 101
    assert line_seq_id("batch_1", 0).startswith("seq-")


# --- pagination ---------------------------------------------------------------------------------
def test_pages_run_newest_first_and_skip_what_expired(r):
    index = OwnerIndex(r, "things", 10**10)
    index.add("o", {f"id{i}": float(i) for i in range(7)})
    alive = {f"id{i}" for i in range(7)} - {"id4"}

    def load(ids):
        return [{"id": i} if i in alive else None for i in ids]

    first = index.page("o", load, limit=3, chunk=2)
    assert [x["id"] for x in first.data] == ["id6", "id5", "id3"] and first.has_more
    rest = index.page("o", load, after="id3", limit=10, chunk=2)
    assert [x["id"] for x in rest.data] == ["id2", "id1", "id0"] and not rest.has_more
    assert index.page("other", load).data == []
    with pytest.raises(UnknownCursor):
        index.page("other", load, after="id3")


def test_files_and_batches_pages_are_not_cut_short_so_the_sdk_pages_them_all(r):
    """The openai SDK asks for the next page after the last object's id and stops at an empty
    page: a page cut short (one file, has_more, last_id past it) made it re-read the same
    entries, get nothing and stop with 1 of 7 files. Only GET /v1/jobs bounds its pages."""
    index = OwnerIndex(r, "files", 10**10)
    index.add("o", {f"f{i}": float(i) for i in range(1300)})
    wanted = {"f1299", "f5", "f3"}          # the batch files among 1,297 batch outputs
    seen, after = [], None
    while True:
        page = index.page("o", lambda ids: [{"id": i} for i in ids], after=after, limit=20,
                          keep=lambda x: x["id"] in wanted)
        seen += [o["id"] for o in page.data]
        if not page.data or not page.has_more:
            break
        after = page.data[-1]["id"]          # as the SDK goes on
    assert seen == ["f1299", "f5", "f3"]


def test_a_filtered_page_passes_over_a_bounded_number_of_entries_and_says_where_to_go_on(r):
    # A filter that matches few of many read the whole index in one request.
    index = OwnerIndex(r, "things", 10**10)
    index.add("o", {f"id{i}": float(i) for i in range(20)})
    wanted, gone, read = {"id17", "id2"}, {"id9"}, []

    def load(ids):
        read.extend(ids)
        return [None if i in gone else {"id": i} for i in ids]

    def walk(**kw):
        pages, after = [], None
        while True:
            read.clear()
            page = index.page("o", load, after=after, limit=1, scan=5, chunk=4,
                              keep=lambda x: x["id"] in wanted, **kw)
            assert len(read) <= 1 + 1 + 5     # the page, one to tell if more follow, the scan
            pages.append(page.as_json())
            if not page.has_more:
                return pages
            after = page.as_json()["last_id"]

    pages = walk()
    # Cut short, a page's last_id is the last entry it looked at, past its data (if any).
    assert [(p["data"], p["last_id"], p["has_more"]) for p in pages] == [
        ([{"id": "id17"}], "id13", True), ([], "id6", True), ([{"id": "id2"}], "id2", False)]
    assert r.zrank(index_key("o", "things"), "id9") is None            # gone: dropped
    # With a peek (what the filter needs, read cheaply), only what it keeps is loaded.
    peeked = []

    def peek(ids):
        peeked.extend(ids)
        return [None if i in gone else {"id": i} for i in ids]

    pages = walk(peek=peek)
    assert [p["data"] for p in pages if p["data"]] == [[{"id": "id17"}], [{"id": "id2"}]]
    assert len(peeked) == 20 - 1


# --- the routes' refusals (Flask app on fakeredis) ------------------------------------------------
@pytest.fixture
def api():
    from app import create_app

    from .factories import RecordingCelery, make_settings

    celery = RecordingCelery()
    app = create_app(make_settings(), redis_client=fakeredis.FakeRedis(decode_responses=True),
                     celery=celery)
    return app.test_client(), celery


def test_each_key_reads_its_own_webhook_secret():
    from app import create_app
    from common.webhook_store import owner_key, secret_of

    from .factories import RecordingCelery, make_settings

    settings = make_settings(api_keys=("key-a", "key-b"),
                             webhook_secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    client = create_app(settings, redis_client=fakeredis.FakeRedis(decode_responses=True),
                        celery=RecordingCelery()).test_client()

    def secret(key: str | None):
        return client.get("/v1/webhooks/secret",
                          headers={"Authorization": f"Bearer {key}"} if key else {})
    a, b = secret("key-a"), secret("key-b")
    assert a.status_code == b.status_code == 200 and a.json["object"] == "webhook_secret"
    assert a.json["secret"].startswith("whsec_") and a.json["secret"] != b.json["secret"]
    assert a.json["secret"] != settings.webhook_secret
    assert a.json == secret("key-a").json                  # stable
    assert secret(None).status_code == 401
    keyless = create_app(make_settings(webhook_secret=settings.webhook_secret),
                         redis_client=fakeredis.FakeRedis(decode_responses=True),
                         celery=RecordingCelery()).test_client()
    assert keyless.get("/v1/webhooks/secret").json["secret"] == secret_of(
        owner_key(settings.webhook_key(), "")) == settings.webhook_secret


def test_without_a_server_secret_the_webhook_secret_route_is_404(api):
    client, _ = api
    r = client.get("/v1/webhooks/secret")
    assert r.status_code == 404 and r.json["error"]["code"] == "webhooks_disabled"


def test_a_webhook_without_a_server_secret_is_400_and_queues_nothing(api):
    client, celery = api
    r = client.post("/v1/jobs", json={"prompt": "x", "webhook": "https://example.com/h"})
    assert r.status_code == 400 and r.json["error"]["param"] == "webhook"
    assert "LLMQ_WEBHOOK_SECRET" in r.json["error"]["message"]
    assert celery.calls == []


@pytest.mark.parametrize("data", [
    {"purpose": "batch", "file": (io.BytesIO(b"\xff\xfe{}"), "x.jsonl")},
    {"purpose": "batch", "file": (io.BytesIO(b"\n \n"), "x.jsonl")},
    {"purpose": "batch"},
    {"file": (io.BytesIO(b"{}\n"), "x.jsonl")},
])
def test_bad_uploads_are_400(api, data):
    client, _ = api
    r = client.post("/v1/files", data=data)
    assert r.status_code == 400 and r.json["error"]["type"] == "invalid_request_error"


def test_a_batch_counts_its_malformed_lines_as_failed_from_the_start(api):
    client, celery = api
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "hi", "max_tokens": 2}}
    raw = "\n".join([json.dumps(good), "{oops", json.dumps(
        {**good, "custom_id": "a"}), "[1, 2]"]).encode()
    f = client.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(raw), "x.jsonl")})
    r = client.post("/v1/batches", json={"input_file_id": f.json["id"],
                                         "endpoint": "/v1/completions",
                                         "completion_window": "24h"})
    assert r.status_code == 200, r.json
    assert r.json["request_counts"] == {"total": 4, "completed": 0, "failed": 3}
    assert [c["name"] for c in celery.calls] == ["llmq.batch"]   # its driver, nothing else yet


def test_delivery_resolves_again_and_never_connects_to_a_private_address(r, monkeypatch):
    """DNS rebinding: the host passed the check at submit and now resolves to 10.0.0.7."""
    from common.batch_store import BatchStore as _Batches
    from common.file_store import FileStore
    from common.store import SequenceStore
    from worker import webhooks
    from worker.celery_app import create_celery
    from worker.services import Services

    from .factories import RecordingCelery, make_settings

    settings = make_settings(webhook_secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    app = create_celery(settings)
    store = WebhookStore(r, 60)
    app.llmq_services = Services(settings, RecordingCelery(), SequenceStore(r), FileStore(r, 60),
                                 _Batches(r, 60), store, ReconcileStore(r, ["llmq"]))
    store.put_event("msg_1", "http://hooks.example.com/in", "{}", "")
    monkeypatch.setattr(webhooks, "check_url", lambda url, allowed: check_url(
        url, allowed, resolve=resolver("10.0.0.7")))
    monkeypatch.setattr(webhooks, "post", lambda *a, **k: pytest.fail("it connected"))
    result = app.tasks["llmq.webhook"].apply(args=["msg_1"]).get()
    assert result["outcome"] == "refused"
    assert store.get_event("msg_1")["last_result"].startswith("refused")
