"""What a stream has sent, kept true across a re-run (the OpenAI chat and completions streams,
and the Responses API's)."""
from __future__ import annotations

from .errors import APIError


class SentText:
    """What an OpenAI stream has sent, kept true across a `reset` (the worker running the
    sequence was lost and another runs it again from the start). Text sent cannot be taken
    back, so the re-run's text is held until it passes what the client has: a re-run that
    repeats it (greedy decoding, or a `seed`) continues the stream seamlessly; one that
    differs ends it with an error. A token costs its own length, not the stream's: what was
    sent is kept in pieces, and a re-run is matched against it piece by piece."""

    def __init__(self):
        self._sent: list[str] = []
        self.rerun_at: int | None = None   # how much of `sent` the re-run has repeated so far
        self.was_reset = False

    @property
    def sent(self) -> str:
        if len(self._sent) > 1:   # joined when read (a reset, the end), not at each token
            self._sent[:] = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def reset(self) -> None:
        self.rerun_at, self.was_reset = 0, True

    def piece(self, text: str) -> str:
        """What to send for a token event's text ("" while a re-run is catching up)."""
        if self.rerun_at is None:
            self._sent.append(text)
            return text
        sent, at = self.sent, self.rerun_at
        self._check(text, sent, at)
        if at + len(text) <= len(sent):
            self.rerun_at = at + len(text)
            return ""
        return self._send(text[len(sent) - at:])

    def rest(self, final_text: str) -> str:
        """At the end: what the client still lacks. A re-run's text past what was sent, or the
        tail the worker held back (the start of a possible stop string, half a character)
        when the sequence ended otherwise: cancelled, timed out, failed."""
        sent = self.sent
        if self.was_reset:
            self._check(final_text, sent, 0)
        elif not final_text.startswith(sent):
            return ""
        return self._send(final_text[len(sent):]) if len(final_text) > len(sent) else ""

    def _send(self, text: str) -> str:
        self._sent.append(text)
        self.rerun_at = None
        return text

    @staticmethod
    def _check(text: str, sent: str, at: int) -> None:
        """A re-run's `text`, starting at `at` in what was sent, must repeat what it overlaps."""
        n = min(len(text), len(sent) - at)
        if text[:n] != sent[at:at + n]:
            raise APIError(500, "the worker running this request was lost and the re-run "
                           "produced different text from what was already streamed; retry the "
                           "request (with temperature 0 or a seed, a re-run repeats itself)",
                           "server_error", code="stream_diverged")
