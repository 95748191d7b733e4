"""The OpenAI response shapes made from finished records (common/openai_responses.py), with
hand-made logprob entries in the worker's shape (worker/logprobs.py)."""
from __future__ import annotations

from common.openai_responses import ChoiceShaper, response_body, vllm_prompt_logprobs


def entry(token_id: int, token: str, logprob: float | None, rank: int | None,
          top: list[tuple[int, str, float]] = ()) -> dict:
    return {"token_id": token_id, "token": token, "logprob": logprob, "rank": rank,
            "top_logprobs": [{"token_id": i, "token": t, "logprob": lp} for i, t, lp in top]}


PROMPT = [entry(7, "The", None, None),
          entry(8, " sky", -2.5, 3, [(9, " sea", -0.5), (10, " cat", -1.0)]),
          entry(11, " is", -0.1, 1, [(11, " is", -0.1)])]


def final(seq_id: str, prompt_logprobs=PROMPT) -> dict:
    return {"id": seq_id, "text": " blue", "finish_reason": "stop", "logprobs": [],
            "prompt_logprobs": prompt_logprobs,
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def test_prompt_logprobs_take_vllms_shape():
    """None for the first token; then the token itself under its own rank, and the top ones
    ranked 1, 2, ... (the sampled-or-given token keeps its rank when it is also on top)."""
    assert vllm_prompt_logprobs(PROMPT) == [
        None,
        {"8": {"logprob": -2.5, "rank": 3, "decoded_token": " sky"},
         "9": {"logprob": -0.5, "rank": 1, "decoded_token": " sea"},
         "10": {"logprob": -1.0, "rank": 2, "decoded_token": " cat"}},
        {"11": {"logprob": -0.1, "rank": 1, "decoded_token": " is"}}]
    assert vllm_prompt_logprobs(None) is None


def test_completions_carry_prompt_logprobs_per_choice_and_chat_beside_the_choices():
    finals = [final("a"), final("b", PROMPT[:2])]
    body = response_body(finals, chat=False, model="m",
                         shaper=ChoiceShaper(finals, chat=False, prompt_logprobs=True))
    assert [len(c["prompt_logprobs"]) for c in body["choices"]] == [3, 2]
    assert "prompt_logprobs" not in body
    chat = response_body(finals[:1], chat=True, model="m",
                         shaper=ChoiceShaper(finals[:1], chat=True, prompt_logprobs=True))
    assert chat["prompt_logprobs"] == vllm_prompt_logprobs(PROMPT)
    assert "prompt_logprobs" not in chat["choices"][0]
    # not asked for: no field at all (a record can hold them for echo)
    plain = response_body(finals, chat=False, model="m")
    assert all("prompt_logprobs" not in c for c in plain["choices"])
