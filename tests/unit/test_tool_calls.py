"""Tool calling and thinking without a model: rendering through a tool-aware chat template
(Hermes style, with tools and <think>, written here), the same prompt from the API's renderer
and transformers', the call grammar, the native and generic parsers, the reasoning split, and
the route's answers (streamed and not) on fakeredis."""
from __future__ import annotations

import json
import shutil

import pytest

from common import reasoning
from common.openai_responses import ChoiceShaper
from common.prompt_counter import PromptCounter
from common.protocol import FinishReason
from common.settings import Settings
from common.store import TokenDelta
from common.structured import grammar_of, validate
from common.tool_calls import (GENERIC, HERMES, LLAMA3, MISTRAL, ToolRequest, detect_format,
                               parse_calls)

from .test_api_unit import Api
from .test_structured_bounds import accepts, lltok  # noqa: F401 - a fixture

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Call a function as <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

# Mistral's own (v3) template, shortened: tools before the last user turn, calls as a JSON list
# after [TOOL_CALLS], and ids that must be 9 letters and digits.
MISTRAL_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST] {{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] [
{%- for call in message.tool_calls %}
{%- if call.id is not defined or call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}
{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def tokenizer_with(tmp_path_factory, default_model_dir, template: str):
    """A folder with the default model's tokenizer and another chat template."""
    folder = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{default_model_dir}/{name}", folder / name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory, default_model_dir):
    """The default model's tokenizer with a Hermes-style template that renders tools."""
    return tokenizer_with(tmp_path_factory, default_model_dir, HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_counter(tmp_path_factory, default_model_dir):
    """The default model's tokenizer with a Mistral-style template."""
    return PromptCounter(tokenizer_with(tmp_path_factory, default_model_dir, MISTRAL_TEMPLATE))


@pytest.fixture(scope="module")
def counter(hermes_dir):
    return PromptCounter(hermes_dir)


def render(counter, tools: ToolRequest, messages, **kwargs) -> str:
    args = {"tools": None, "documents": None, **counter.special, **kwargs,
            **tools.template_args()}
    return counter.template.render(messages=tools.messages(messages),
                                   add_generation_prompt=True, **args)


# --- formats and rendering --------------------------------------------------------------------
def test_formats_are_recognised_from_the_template(counter, default_model_dir):
    assert detect_format(counter.template_source) == HERMES
    assert reasoning.template_reasons(counter.template_source)
    smol = PromptCounter(__import__("pathlib").Path(default_model_dir))
    assert detect_format(smol.template_source) == GENERIC
    assert not reasoning.template_reasons(smol.template_source)
    assert detect_format("{% if tools %}<|python_tag|>{{ x }}{% endif %}") == LLAMA3


def test_a_native_template_renders_the_tools_and_the_past_call(counter):
    text = render(counter, ToolRequest([WEATHER], "auto", True, HERMES), CONVERSATION)
    assert "<tools>" + json.dumps(WEATHER, ensure_ascii=False) + "</tools>" in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>') in text   # the arguments as an object, as templates read them
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    # tool_choice none: no tools reach the template
    plain = render(counter, ToolRequest([WEATHER], "none", True, HERMES), CONVERSATION)
    assert "<tools>" not in plain and "<tool_response>" in plain


def test_transformers_renders_what_the_api_counts(counter, hermes_dir):
    """The worker renders with transformers' apply_chat_template, the API counts with its own
    jinja: the same arguments give the same prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hermes_dir))
    tools = ToolRequest([WEATHER], "required", True, HERMES)
    for kwargs in ({}, {"enable_thinking": False}):
        ours = render(counter, tools, CONVERSATION, **kwargs)
        theirs = tok.apply_chat_template(tools.messages(CONVERSATION), tokenize=False,
                                         add_generation_prompt=True,
                                         **kwargs, **tools.template_args())
        assert ours == theirs


def test_enable_thinking_changes_the_rendered_prompt(counter):
    tools = ToolRequest([], "none", True, HERMES)
    on = render(counter, tools, CONVERSATION[:2])
    off = render(counter, tools, CONVERSATION[:2], enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"


def test_the_generic_format_describes_the_tools_in_the_system_prompt():
    tools = ToolRequest([WEATHER], "auto", True, GENERIC)
    msgs = tools.messages(CONVERSATION)
    assert msgs[0]["role"] == "system" and msgs[0]["content"].startswith("Be brief.\n\n")
    assert '"name": "get_weather"' in msgs[0]["content"] and '{"response"' in msgs[0]["content"]
    assert json.loads(msgs[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert msgs[3]["role"] == "user"
    assert json.loads(msgs[3]["content"])["tool_response"]["content"] == '{"temp": 21}'
    assert tools.template_args() == {}
    assert all(set(m) == {"role", "content"} for m in msgs)


# --- grammars ---------------------------------------------------------------------------------
def test_a_required_hermes_call_decodes_under_the_tools_schema(lltok):
    spec = ToolRequest([WEATHER], "required", False, HERMES).structured_spec()
    assert validate(spec) is None
    assert accepts(lltok, spec, '<tool_call>\n{"name": "get_weather", "arguments": '
                                '{"city": "Paris", "days": 2}}\n</tool_call>')
    assert not accepts(lltok, spec, 'Sure! <tool_call>')
    assert not accepts(lltok, spec, '<tool_call>\n{"name": "get_time"')
    assert not accepts(lltok, spec, '<tool_call>\n{"name": "get_weather", "arguments": '
                                    '{"city": "Paris", "days": ' + "1" * 30)


def test_generic_grammars(lltok):
    required = ToolRequest([WEATHER], "required", False, GENERIC).structured_spec()
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert accepts(lltok, required, call)
    assert not accepts(lltok, required, '{"response": "hi"}')
    assert not accepts(lltok, required, call[:-2] + ', {')   # one call: not parallel
    auto = ToolRequest([WEATHER], "auto", True, GENERIC).structured_spec()
    assert accepts(lltok, auto, call) and accepts(lltok, auto, '{"response": "hi"}')
    assert ToolRequest([WEATHER], "none", True, GENERIC).structured_spec() is None
    assert ToolRequest([WEATHER], "auto", True, LLAMA3).structured_spec() is None


def test_hermes_auto_is_free_text_until_a_call_opens(lltok):
    """A lazy grammar: text passes, a call that opens must follow the tools' schema."""
    spec = ToolRequest([WEATHER], "auto", True, HERMES).structured_spec()
    assert validate(spec) is None
    assert accepts(lltok, spec, "It is sunny, no tool needed.")
    assert accepts(lltok, spec, 'Let me look.<tool_call>\n{"name": "get_weather", '
                                '"arguments": {"city": "Rome"}}\n</tool_call>')
    assert not accepts(lltok, spec, 'Let me look.<tool_call>\n{"name": "rm"')
    assert not accepts(lltok, spec, '<tool_call>\n{"name": "get_weather", "arguments": '
                                    '{"city": "Rome", "days": ' + "9" * 30)
    llama = ToolRequest([WEATHER], "required", True, LLAMA3).structured_spec()
    assert accepts(lltok, llama, '{"name": "get_weather", "parameters": {"city": "Rome"}}')


# --- parsing ----------------------------------------------------------------------------------
SHAPE = {"names": ["get_weather"]}


def test_hermes_calls_are_parsed_with_the_text_around_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}'
            '\n</tool_call>')
    content, calls = parse_calls(text, {**SHAPE, "format": HERMES}, "seq-1")
    assert content == "Let me check."
    assert [c["id"] for c in calls] == ["call_seq-1_0", "call_seq-1_1"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "A"},
                                                                       {"city": "B"}]


def test_llama3_and_generic_calls_are_parsed():
    content, [call] = parse_calls('<|python_tag|>{"name": "get_weather", "parameters": '
                                  '{"city": "A"}}', {**SHAPE, "format": LLAMA3}, "s")
    assert content is None and call["function"]["name"] == "get_weather"
    content, calls = parse_calls('{"response": "Sunny."}', {**SHAPE, "format": GENERIC}, "s")
    assert (content, calls) == ("Sunny.", [])


def test_a_mistral_template_renders_tools_and_past_calls(mistral_counter):
    assert detect_format(mistral_counter.template_source) == MISTRAL
    tools = ToolRequest([WEATHER], "auto", True, MISTRAL)
    # OpenAI's ids are longer than Mistral's 9 characters, which its template refuses.
    conversation = [*CONVERSATION[:2], {**CONVERSATION[2], "tool_calls": [
        {**CONVERSATION[2]["tool_calls"][0], "id": "call_seq-abc_0"}]},
        {**CONVERSATION[3], "tool_call_id": "call_seq-abc_0"}, CONVERSATION[1]]
    text = render(mistral_counter, tools, conversation)
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "llseqabc0"}]') in text   # its last 9 letters and digits
    assert '"call_id": "llseqabc0"' in text
    assert "[AVAILABLE_TOOLS] " + json.dumps([WEATHER]) in text
    assert tools.structured_spec() is None   # auto: parsed after the fact


def test_mistral_calls_are_parsed_with_and_without_the_marker():
    shape = {**SHAPE, "format": MISTRAL}
    calls = '[{"name": "get_weather", "arguments": {"city": "A"}}, ' \
            '{"name": "get_weather", "arguments": {"city": "B"}}]'
    content, found = parse_calls("Checking. [TOOL_CALLS]" + calls, shape, "s")
    assert content == "Checking."
    assert [json.loads(c["function"]["arguments"]) for c in found] == [{"city": "A"},
                                                                       {"city": "B"}]
    # The marker is a special token: a detokenizer that skips those leaves the list alone.
    content, found = parse_calls(" " + calls, shape, "s")
    assert content is None and len(found) == 2
    assert parse_calls("[1, 2]", shape, "s") == ("[1, 2]", [])


def test_a_required_mistral_call_decodes_under_the_tools_schema(lltok):
    spec = ToolRequest([WEATHER], "required", False, MISTRAL).structured_spec()
    call = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert validate(spec) is None and accepts(lltok, spec, call)
    assert not accepts(lltok, spec, call[:-1] + ", {")   # one call: not parallel
    assert not accepts(lltok, spec, '[{"name": "get_time"')
    content, [found] = parse_calls(call, {**SHAPE, "format": MISTRAL}, "s")
    assert found["function"]["name"] == "get_weather"


@pytest.mark.parametrize("fmt,text", [
    (HERMES, '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),   # not a tool
    (HERMES, "<tool_call>\n{not json"),
    (LLAMA3, '{"name": "get_weather", "parameters": "x"}'),   # arguments not an object
    (GENERIC, "plain text"),
])
def test_what_is_not_a_valid_call_stays_content(fmt, text):
    assert parse_calls(text, {**SHAPE, "format": fmt}, "s") == (text, [])


# --- reasoning --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    ("<think>\nhmm\n</think>\n\nParis.", ("hmm\n", "Paris.")),
    ("<think>cut short", ("cut short", "")),
    ("No thinking.", (None, "No thinking.")),
    ("<think>\n\n</think>\n\nOff.", ("", "Off.")),   # enable_thinking false: empty thought
])
def test_reasoning_is_split_the_same_streamed_and_not(text, expected):
    assert reasoning.split(text) == expected
    for step in (1, 2, 3, 7):
        splitter, got = reasoning.ReasoningSplitter(), ["", ""]
        for i in range(0, len(text), step):
            for k, part in enumerate(splitter.feed(text[i:i + step])):
                got[k] += part
        for k, part in enumerate(splitter.flush()):
            got[k] += part
        assert (got[0] or None if expected[0] is None else got[0], got[1]) == expected


def test_a_message_carries_reasoning_and_calls():
    shaper = ChoiceShaper([{"id": "s"}], True, reasoning=True, tools={**SHAPE, "format": HERMES})
    text = ('<think>Need weather.</think>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "A"}}\n</tool_call>')
    choice = shaper.choice(0, text, [], "stop")
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == "Need weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "A"}'
    # streamed: held to the end, then reasoning, the call's id and name, its arguments
    assert shaper.deltas(0, text[:20]) == []
    deltas, finish = shaper.end_deltas(0, text[20:], "stop")
    assert finish == "tool_calls"
    assert deltas == [{"reasoning_content": "Need weather."},
                      {"tool_calls": [{"index": 0, "id": "call_s_0", "type": "function",
                                       "function": {"name": "get_weather", "arguments": ""}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "A"}'}}]}]


# --- the route --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def _thinking_api():
    return Api(wait_timeout_s=5, chat_template_kwargs='{"enable_thinking": false, "a": 1}')


def test_template_kwargs_reach_the_record_over_the_servers_default(_thinking_api):
    a = _thinking_api.reset()
    resp = a.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "stream": True,
        "chat_template_kwargs": {"a": 2}}, buffered=False)
    req = a.store.load_request(resp.headers["X-Request-Id"])
    assert req.template_args == {"enable_thinking": False, "a": 2}
    resp.close()


def test_a_bad_default_template_kwargs_stops_the_settings():
    with pytest.raises(ValueError, match="LLMQ_CHAT_TEMPLATE_KWARGS"):
        Settings(chat_template_kwargs="[1]")


def test_the_route_streams_a_call(_thinking_api):
    a = _thinking_api.reset()
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
            "tool_choice": "required"}

    resp = a.client.post("/v1/chat/completions", json={**body, "stream": True},
                         buffered=False)
    jid = resp.headers["X-Request-Id"]
    a.store.start(jid, "w1")
    a.store.publish_deltas([TokenDelta(jid, text[:20], 1)])
    a.store.publish_deltas([TokenDelta(jid, text[20:], 2)])
    a.store.finish(jid, FinishReason.STOP, text=text, completion_tokens=2)
    chunks = [json.loads(line[6:]) for line in resp.get_data(as_text=True).split("\n\n")
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[2]["tool_calls"][0]["function"] == {"arguments": '{"city": "Oslo"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("content" in d and d["content"] for d in deltas)


def test_reasoning_tokens_count_the_thinking():
    usage = reasoning.add_reasoning_tokens({}, ["<think>ab</think>c", "no thought"], len)
    assert usage == {"completion_tokens_details": {"reasoning_tokens": len("<think>ab</think>")}}


def test_a_thinking_models_stream_splits_reasoning_content(hermes_dir):
    """A model whose template names <think>: the route streams delta.reasoning_content, then
    content, and counts the thinking in usage."""
    a = Api(model=str(hermes_dir))
    text = "<think>\nThe user asks.\n</think>\n\nParis."
    resp = a.client.post("/v1/chat/completions", buffered=False, json={
        "messages": [{"role": "user", "content": "x"}], "stream": True,
        "stream_options": {"include_usage": True}})
    jid = resp.headers["X-Request-Id"]
    a.store.start(jid, "w1")
    for k in range(0, len(text), 4):
        a.store.publish_deltas([TokenDelta(jid, text[k:k + 4], k // 4 + 1)])
    a.store.finish(jid, FinishReason.STOP, text=text, completion_tokens=len(text) // 4 + 1)
    chunks = [json.loads(line[6:]) for line in resp.get_data(as_text=True).split("\n\n")
              if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks.\n"
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    details = chunks[-1]["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == len(PromptCounter(hermes_dir).tokenizer.encode(
        "<think>\nThe user asks.\n</think>", add_special_tokens=False).ids)



def test_a_batch_line_with_tools_answers_the_call(monkeypatch):
    """A /v1/batches line is checked, rendered and shaped as the route does it: its request
    keeps the grammar and the rendered tools, and its output line carries the call."""
    from common.batch_store import line_seq_id

    from . import test_batches_api as batches

    monkeypatch.setattr(batches, "create", lambda api, fid, headers=batches.K1: (
        api.client.post("/v1/batches", headers=headers, json={
            "input_file_id": fid, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})))
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
            "tool_choice": "required"}
    line = json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": body})
    driver, seqs, bid = batches.a_driver_past_its_first_submit(Api(api_keys=("k1",)), line)
    seq_id = line_seq_id(bid, 0)
    req = seqs.load_request(seq_id)
    assert req.params.structured["type"] == "json_schema"
    assert "get_weather" in req.messages[0]["content"]   # the generic format's system prompt
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    seqs.start(seq_id, "w1")
    seqs.finish(seq_id, FinishReason.STOP, text=text, completion_tokens=9)
    driver.collect()
    [out] = [json.loads(x) for x in driver.svc.batches.answered(bid, "out")]
    choice = out["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_the_job_keeps_its_tool_calls(_thinking_api):
    """GET /v1/jobs/<id> of a chat completion with tools shows the calls it made."""
    a = _thinking_api.reset()
    resp = a.client.post("/v1/chat/completions", buffered=False, json={
        "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
        "tool_choice": "required", "stream": True})
    jid = resp.headers["X-Request-Id"]
    a.store.start(jid, "w1")
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    a.store.finish(jid, FinishReason.STOP, text=text, completion_tokens=9)
    assert '"finish_reason": "tool_calls"' in resp.get_data(as_text=True)
    job = a.client.get(f"/v1/jobs/{jid}").get_json()
    assert job["text"] == text
    assert job["tool_calls"] == [{"id": f"call_{jid}_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]


def test_jobs_take_tools_with_messages(_thinking_api):
    """/v1/jobs: tools and chat_template_kwargs with messages, the call under the grammar,
    and the job's tool_calls once it ends."""
    a = _thinking_api.reset()
    resp = a.client.post("/v1/jobs", json={
        "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert resp.status_code == 202, resp.get_data(as_text=True)
    jid = resp.get_json()["id"]
    req = a.store.load_request(jid)
    assert req.params.structured["type"] == "json_schema"
    assert req.template_args == {"enable_thinking": False, "a": 1}
    a.store.start(jid, "w1")
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    a.store.finish(jid, FinishReason.STOP, text=text, completion_tokens=9)
    assert a.client.get(f"/v1/jobs/{jid}").get_json()["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    for body, param in (({"prompt": "x", "tools": [WEATHER]}, None),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                          "tool_choice": "nope"}, "tool_choice")):
        bad = a.client.post("/v1/jobs", json=body)
        assert bad.status_code == 400, bad.get_data(as_text=True)
