import requests


def test_generate_round_trip(stack):
    r = requests.post(stack["url"] + "/v1/generate",
                      json={"prompt": "Hello there", "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "succeeded"
    assert job["usage"]["completion_tokens"] == 8
    assert job["finish_reason"] == "length"
