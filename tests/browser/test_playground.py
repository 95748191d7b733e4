"""The playground page (GET /) in a real browser: headless Debian Chromium driven by Playwright.

Playwright's own browser download cannot be used here; the system's /usr/bin/chromium can
(`.ci/run` installs it with apt). Without it, or without the playwright package, these tests
skip and say why.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; .ci/run installs it)",
                allow_module_level=True)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (it is in requirements-dev.txt)")

pytestmark = pytest.mark.integration

LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--disable-sync"]
TIMEOUT_MS = 90_000

# Records, for every change of the output box, when (browser clock, ms since the epoch), how
# long the text was and what the status read: the test reads it back to see the text grow.
OBSERVER = """() => {
  window.__changes = [];
  const out = document.getElementById("output"), status = document.getElementById("status");
  new MutationObserver(() => window.__changes.push(
      {t: Date.now(), len: out.textContent.length, status: status.textContent}))
    .observe(out, {childList: true, characterData: true, subtree: true});
}"""


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, stack):
    context = browser.new_context()
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    pg.on("console", lambda msg: msg.type == "error" and errors.append(f"console: {msg.text}"))
    pg.goto(stack["url"] + "/")
    assert pg.title() == "llmq playground"
    pg.evaluate(OBSERVER)
    yield pg
    context.close()
    assert errors == []   # no JavaScript errors, no failed requests logged by the page


def fill_form(page, prompt: str, max_tokens: int) -> None:
    page.fill("#prompt", prompt)
    page.select_option("#mode", "raw")
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.check("#ignore_eos")   # the random model must not end early


def text_of(page, selector: str) -> str:
    return page.locator(selector).text_content()


def get_job(stack, seq_id: str) -> dict:
    r = requests.get(f"{stack['url']}/v1/jobs/{seq_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_send_streams_the_output_and_shows_the_result(page, stack):
    expect = sync_api.expect
    fill_form(page, "Once upon a time", 100)
    page.click("#send")
    expect(page.locator("#send")).to_be_disabled()
    page.wait_for_function("document.getElementById('output').textContent.length > 0")
    expect(page.locator("#status")).to_have_text("succeeded", timeout=TIMEOUT_MS)

    seq_id = text_of(page, "#job-id")
    assert seq_id.startswith("seq-")
    job = get_job(stack, seq_id)
    assert job["prompt"] == "Once upon a time"   # raw mode sent a prompt, not messages
    assert job["status"] == "succeeded" and job["finish_reason"] == "length"
    assert job["usage"]["completion_tokens"] == 100
    # The page shows exactly the job's text, its usage, finish reason and timings.
    assert text_of(page, "#output") == job["text"]
    assert text_of(page, "#usage") == f"{job['usage']['prompt_tokens']} in / 100 out"
    assert text_of(page, "#finish") == "length"
    assert text_of(page, "#ttft").endswith(" s") and text_of(page, "#elapsed").endswith(" s")
    assert "status-succeeded" in page.get_attribute("#status", "class")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#cancel")).to_be_disabled()
    assert text_of(page, "#error") == ""

    # The text grew token by token while the job ran, not in one block at its end.
    changes = [c for c in page.evaluate("window.__changes") if c["len"] > 0]
    lengths = [c["len"] for c in changes]
    assert len(set(lengths)) > 5 and lengths == sorted(lengths), lengths
    assert any(c["status"] == "running" for c in changes)
    assert changes[0]["t"] / 1000 < job["finished_at"], (changes[0], job["finished_at"])


def test_cancel_stops_a_long_generation(page, stack):
    expect = sync_api.expect
    fill_form(page, "Tell me a very long story", 400)
    page.click("#send")
    page.wait_for_function("document.getElementById('output').textContent.length > 0")
    expect(page.locator("#cancel")).to_be_enabled()
    page.click("#cancel")
    expect(page.locator("#status")).to_have_text("cancelled", timeout=TIMEOUT_MS)

    seq_id = text_of(page, "#job-id")
    job = get_job(stack, seq_id)
    assert job["status"] == "cancelled" and job["finish_reason"] == "cancelled"
    assert job["usage"]["completion_tokens"] < 400
    assert text_of(page, "#finish") == "cancelled"
    assert text_of(page, "#output") == job["text"]   # what streamed is what the job kept
    assert "status-cancelled" in page.get_attribute("#status", "class")
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#cancel")).to_be_disabled()
    assert text_of(page, "#error") == ""
