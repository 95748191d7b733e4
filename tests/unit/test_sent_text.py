"""SentText, an OpenAI stream's record of what it sent, across resets: what it sends for each
token event and at the end, against the plain definition (the whole re-run compared with the
whole text sent, at every token), over long and random streams."""
from __future__ import annotations

import random

import pytest

from app.errors import APIError
from app.sent_text import SentText


class Reference:
    """The definition: a re-run's text is held until it passes what was sent, and must repeat
    it; each step compares the whole texts."""

    def __init__(self):
        self.sent, self.rerun, self.was_reset = "", None, False

    def reset(self):
        self.rerun, self.was_reset = "", True

    def piece(self, text):
        if self.rerun is None:
            self.sent += text
            return text
        self.rerun += text
        return self._catch_up(self.rerun)

    def rest(self, final):
        if self.was_reset:
            return self._catch_up(final)
        return final[len(self.sent):] if final.startswith(self.sent) else ""

    def _catch_up(self, text):
        n = min(len(text), len(self.sent))
        if text[:n] != self.sent[:n]:
            raise ValueError("diverged")
        if len(text) <= len(self.sent):
            return ""
        out, self.sent, self.rerun = text[len(self.sent):], text, None
        return out


def run(tracker, script):
    out = []
    for op, arg in script:
        try:
            out.append(getattr(tracker, op)(*([arg] if arg is not None else [])))
        except (APIError, ValueError):
            out.append("diverged")
            break
    return out


def random_script(rng):
    """Token events, resets (a re-run that repeats, or differs) and the end."""
    words = ["a", "b", "ab", "é", "🎉", " ", "xyz"]
    script, text = [], ""
    for _ in range(rng.randrange(1, 40)):
        if rng.random() < 0.1:
            script.append(("reset", None))
            if text and rng.random() < 0.7:   # a re-run that repeats it, in other pieces
                cuts = sorted(rng.sample(range(1, len(text) + 1), min(3, len(text))))
                script += [("piece", text[a:b]) for a, b in zip([0] + cuts, cuts)]
                text = text[:cuts[-1]]
            else:
                text = ""
        else:
            w = rng.choice(words)
            text += w
            script.append(("piece", w))
    script.append(("rest", text + rng.choice(["", "tail"])))
    return script


@pytest.mark.parametrize("seed", range(200))
def test_it_sends_what_the_definition_sends(seed):
    script = random_script(random.Random(seed))
    assert run(SentText(), script) == run(Reference(), script), script


def test_a_long_stream_a_reset_and_a_rerun_that_repeats_it():
    words = [f" w{i}" for i in range(8000)]
    t = SentText()
    assert [t.piece(w) for w in words] == words
    t.reset()
    assert [t.piece(w) for w in words[:-1]] == [""] * 7999   # catching up: nothing new
    assert t.piece(words[-1] + " more") == " more"
    assert t.piece(" and") == " and"
    assert t.rest("".join(words) + " more and!") == "!"
    assert t.sent == "".join(words) + " more and!"


def test_a_rerun_that_differs_ends_the_stream():
    t = SentText()
    for w in ["Hello", " world"]:
        t.piece(w)
    t.reset()
    assert t.piece("Hel") == ""
    with pytest.raises(APIError) as err:
        t.piece("p")
    assert err.value.code == "stream_diverged"
