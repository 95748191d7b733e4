"""Structured output in the model worker: the grammar mask in llmq's sampling step.

The tiny random model left alone writes noise; with a grammar its tokens must parse (JSON that
matches the schema, a regex, one of the choices), constrained rows share the batch with free
ones, and the free rows' tokens are exactly what they are alone.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from common.protocol import SamplingParams
from common.structured import validate
from factories import GREEDY, Driver, make_prompts, new_seq, run_batch, run_solo
from worker.model.transformers.backend import TransformersBackend
from worker.model.structured_output import SPARSE_WORDS, apply_bitmask

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "kind": {"enum": ["cat", "dog"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 20},
                         "vaccinated": {"type": "boolean"}},
          "required": ["name", "kind", "age", "vaccinated"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def constrained(spec: dict, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), structured=spec, **kw)


def text_until_eos(tokenizer, ids: list[int], eos: tuple[int, ...]) -> str:
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    assert cut < len(ids), "the grammar ended, so the next token is EOS"
    return tokenizer.decode(ids[:cut])


def test_apply_bitmask_keeps_exactly_the_set_bits():
    gen = torch.Generator().manual_seed(0)
    vocab = 100   # not a multiple of 32: the last word is partly used
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    out = logits.clone()
    apply_bitmask(out, bitmask)
    assert_masked(out, logits, bitmask)


def assert_masked(out, logits, bitmask):
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert out[r, t] == (logits[r, t] if allowed else float("-inf")), (r, t)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, 2]])
def test_sparse_and_dense_rows_share_a_mask(rows):
    """Rows with few allowed tokens (a JSON grammar's usual step) take the sparse path, the
    others the dense one; in a batch of both each row keeps exactly its bits."""
    gen = torch.Generator().manual_seed(1)
    words = SPARSE_WORDS * 3
    vocab = 32 * words - 7
    bitmask = torch.zeros((4, words), dtype=torch.int32)
    bitmask[0, [3, words - 1]] = torch.tensor([0b1011, -1], dtype=torch.int32)  # sparse
    bitmask[1] = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
    bitmask[2, :SPARSE_WORDS] = -1   # as many words as the sparse path takes
    bitmask[3] = -1                  # everything allowed
    logits = torch.randn(4, vocab, generator=gen)[rows]
    out = logits.clone()
    apply_bitmask(out, bitmask[rows])
    assert_masked(out, logits, bitmask[rows])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_rows_parse_beside_free_rows(tiny_model, tokenizer, temperature):
    model, info = tiny_model
    prompts = make_prompts(4, lengths=[9, 30, 4, 17], seed=3)
    spec = {"type": "json_schema", "value": SCHEMA}
    free_alone = run_solo(TransformersBackend(model, info, 8), prompts[1], 40)
    params = {"j1": constrained(spec, temperature=temperature, seed=1), "free": GREEDY,
              "j2": constrained(spec, temperature=temperature, seed=2),
              "free2": SamplingParams(temperature=1.0, seed=9)}
    out = run_batch(TransformersBackend(model, info, 8),
                    {"j1": prompts[0], "free": prompts[1], "j2": prompts[2], "free2": prompts[3]},
                    40, params)
    for sid in ("j1", "j2"):
        doc = json.loads(text_until_eos(tokenizer, out[sid], info.eos_token_ids))
        assert set(doc) == {"name", "kind", "age", "vaccinated"}
        assert doc["kind"] in ("cat", "dog") and 0 <= doc["age"] <= 20
        assert isinstance(doc["vaccinated"], bool) and len(doc["name"]) <= 6
    assert out["free"] == free_alone   # the mask touches constrained rows only
    # The free sampled row is noise (no JSON, mostly distinct tokens).
    assert len(set(out["free2"])) > 30


def test_regex_choice_and_json_object(tiny_model, tokenizer):
    model, info = tiny_model
    prompts = make_prompts(3, lengths=[5, 12, 8], seed=11)
    specs = {"re": {"type": "regex", "value": r"[0-9]{3}-[a-z]{2}"},
             "choice": {"type": "choice", "value": ["alpha", "beta gamma"]},
             "obj": {"type": "json_object"}}
    out = run_batch(TransformersBackend(model, info, 8), dict(zip(specs, prompts)), 48,
                    {k: constrained(v, temperature=1.0, seed=4) for k, v in specs.items()})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text_until_eos(tokenizer, out["re"],
                                                             info.eos_token_ids))
    assert text_until_eos(tokenizer, out["choice"], info.eos_token_ids) in ("alpha", "beta gamma")
    assert isinstance(json.loads(text_until_eos(tokenizer, out["obj"], info.eos_token_ids)), dict)


def test_a_restarted_sequence_resumes_its_grammar(tiny_model, tokenizer):
    """After a model-process restart the sequence comes back with its output so far: the new
    matcher is advanced over it and the text still parses, the same as without the restart."""
    model, info = tiny_model
    prompt = make_prompts(1, lengths=[10], seed=8)[0]
    params = constrained({"type": "json_schema", "value": SCHEMA}, temperature=1.0, seed=5)
    whole = run_solo(TransformersBackend(model, info, 4), prompt, 30, params)
    d = Driver(TransformersBackend(model, info, 4))
    d.step(prefill=[new_seq("s", prompt, params)])
    for _ in range(5):
        d.step()
    made = d.outputs["s"]
    fresh = Driver(TransformersBackend(model, info, 4))   # the restarted process
    seq = new_seq("s", prompt + made, params)
    seq.num_output_tokens = len(made)
    fresh.step(prefill=[seq])
    for _ in range(30 - len(made) - 1):
        fresh.step()
    assert made + fresh.outputs["s"] == whole


def test_a_schema_that_cannot_compile_is_named():
    assert validate({"type": "json_schema", "value": {"type": "objectx"}})
    assert validate({"type": "regex", "value": "[a-"})
    assert validate({"type": "json_schema", "value": SCHEMA}) is None


def test_min_tokens_past_a_finished_grammar_still_samples(tiny_model, tokenizer):
    """A finished grammar allows only EOS, and min_tokens blocks EOS: the row keeps EOS rather
    than having no token left at all (which made sampling fail, and with it the batch)."""
    model, info = tiny_model
    prompt = make_prompts(1, lengths=[6], seed=2)[0]
    params = constrained({"type": "choice", "value": ["ok"]}, temperature=1.0, seed=1,
                         min_tokens=4)
    d = Driver(TransformersBackend(model, info, 4))
    d.step(prefill=[new_seq("s", prompt, params, stop_token_ids=info.eos_token_ids)])
    for _ in range(3):
        d.step()
    out = d.outputs["s"]
    assert tokenizer.decode(out[:1]) == "ok" and out[1] in info.eos_token_ids
