"""IncrementalDetokenizer against the real tokenizer of the default model (SmolLM2, byte BPE)."""
from __future__ import annotations

import random

import pytest

from worker.detokenizer import IncrementalDetokenizer

TEXTS = [
    "naïve café 東京 🎉👩‍👩‍👧",
    "Hello, world! Ça va? Größe, señor, smörgåsbord.",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "emoji run: 😀😃😄😁🤖🚀✨ and flags 🇫🇷🇯🇵 and skin tones 👍🏽👋🏿",
    "  leading spaces,\ttabs\n\nnewlines and   runs   of spaces  ",
    "math ∑∫√∞ ≠ ≤ ≥ → ← and symbols ©®™ € £ ¥",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "code: def f(x):\n    return x ** 2  # 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def stream(tok, ids, prompt_ids=None):
    detok = IncrementalDetokenizer(tok, prompt_ids)
    return [detok.step(t) for t in ids] + [detok.flush()]


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_are_whole_characters_and_add_up(tok, text):
    ids = encode(tok, text)
    assert len(ids) > 3
    deltas = stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text


def test_multibyte_characters_really_are_split_across_tokens(tok):
    """Guards the test itself: the tokenizer splits these characters into byte tokens, so a
    naive per-token decode would emit U+FFFD; the detokenizer must hold them back."""
    text = TEXTS[0]
    ids = encode(tok, text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    deltas = stream(tok, ids)
    assert "" in deltas[:-1]                          # something was held back at least once


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context(tok, text):
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something 🎉"}],
                                     tokenize=False, add_generation_prompt=True)
    prompt_ids = encode(tok, prompt)
    ids = encode(tok, text)
    deltas = stream(tok, ids, prompt_ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_prompt_context_keeps_leading_space_of_first_token(tok):
    prompt_ids = encode(tok, "The answer is")
    ids = encode(tok, " forty-two, naïvely 🎉")
    deltas = stream(tok, ids, prompt_ids)
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == " forty-two, naïvely 🎉"


def test_special_tokens_are_skipped_mid_stream(tok):
    eos = tok.eos_token_id
    ids = encode(tok, "Hello 🎉") + [eos] + encode(tok, " café") + [eos]
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "Hello 🎉 café"
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_kept_when_not_skipped(tok):
    eos = tok.eos_token_id
    ids = encode(tok, "Hi") + [eos]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.step(t) for t in ids) + detok.flush()
    assert text == "Hi" + tok.eos_token


def test_flush_releases_a_trailing_incomplete_character(tok):
    ids = encode(tok, "ok 🎉")
    ids = ids[:-1]                                    # cut the emoji's last byte token
    deltas = stream(tok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])       # held back while incomplete...
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)   # ...flushed at the end
    assert deltas[-1].endswith("\ufffd")


def test_flush_twice_adds_nothing(tok):
    detok = IncrementalDetokenizer(tok)
    for t in encode(tok, "abc 東京"):
        detok.step(t)
    detok.flush()
    assert detok.flush() == ""


def test_empty_stream(tok):
    assert IncrementalDetokenizer(tok, []).flush() == ""


@pytest.mark.parametrize("seed", range(3))
def test_random_token_ids_always_add_up(tok, seed):
    """Arbitrary ids (byte tokens in any order, special tokens): the pieces still add up."""
    rng = random.Random(seed)
    vocab = len(tok)
    for _ in range(40):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        deltas = stream(tok, ids, prompt or None)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), (prompt, ids)


class SentencePieceLike:
    """A tokenizer whose decode depends on context, like SentencePiece (Llama, Mistral): pieces
    mark a leading space with U+2581, and the first space of a decoded text is dropped."""

    PIECES = ["<s>", "\u2581Hello", "\u2581world", ",", "\u2581caf", "é", "!"]

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))
        return text.replace("\u2581", " ").removeprefix(" ")


def test_context_dependent_decoding_keeps_the_spaces():
    """Decoding each token alone would lose its leading space; the window keeps it."""
    tok = SentencePieceLike()
    ids = [1, 3, 2, 0, 4, 5, 6]
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "Hello, world café!"
    deltas = stream(tok, [4, 5], prompt_ids=[0, 1, 2])
    assert "".join(deltas) == " café"                  # the space belongs to the output


class WindowWatch:
    """A tokenizer wrapped to record the longest list of ids it was asked to decode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_run_of_skipped_special_tokens_does_not_widen_the_window(tok):
    """EOS after EOS (ignore_eos past the answer's end): each token's decode stays as short as
    at the start, and the text is the full decode's."""
    eos = tok.eos_token_id
    ids = encode(tok, "Hello") + [eos] * 2000 + encode(tok, " café 🎉") + [eos] * 5
    watch = WindowWatch(tok)
    deltas = stream(watch, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "Hello café 🎉"
    assert watch.longest <= 12


def test_a_long_text_decodes_in_a_window_that_does_not_grow(tok):
    """8,000 tokens of hand-made ids (words, multi-byte characters split into byte tokens,
    special tokens): the deltas add up to the full decode, each decode is a few tokens."""
    rng = random.Random(7)
    ids = []
    while len(ids) < 8000:
        ids += encode(tok, rng.choice(TEXTS)) + ([tok.eos_token_id] if rng.random() < 0.3 else [])
    watch = WindowWatch(tok)
    deltas = stream(watch, ids, encode(tok, "The answer is"))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert watch.longest <= 16
