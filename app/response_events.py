"""A response's stream events, numbered from its sequence's stored event stream.

The events are a function of the stream's entries, in order, and of nothing else (not the
time they are read, not the record's state then): fed the same entries, a log yields the same
events with the same `sequence_number`s. So `GET /v1/responses/{id}?stream=true&starting_after=N`
replays the stream from its first entry, drops the events numbered N or less and follows the
live ones with the same log: exactly the events after N, whether the client saw them live or
not.

How entries map to events:
- before any entry: response.created (0), carrying the response as it was accepted
  (status queued for a background response, in_progress otherwise);
- the first token entry (or a done entry with output): response.in_progress,
  response.output_item.added and response.content_part.added;
- each token entry whose text adds to what was sent: one response.output_text.delta; a token
  with no text (a special token, half a character) gives none;
- a reset entry (the worker running it was lost; the sequence runs again from its prompt)
  gives nothing. Text sent cannot be taken back, so the re-run's text is held until it passes
  what was sent (app/sent_text.SentText, as the chat stream does): a re-run that repeats it
  (greedy, or a seed) continues with the next number; one that differs ends the stream with an
  `error` event (code stream_diverged), the same one at the same number on every replay. GET
  without stream still shows the final text;
- the done entry: the rest of the text as a delta, response.output_text.done,
  response.content_part.done, response.output_item.done, then response.completed,
  .incomplete, .failed or .cancelled with the final response.

Resumption needs the stream's entries from the first: a stream longer than LLMQ_STREAM_MAXLEN
entries (trimmed) cannot be replayed exactly.
"""
from __future__ import annotations

from typing import Any

from common.protocol import EVENT_DONE, EVENT_RESET, EVENT_TOKEN
from common.response_objects import TERMINAL_EVENTS, EventShapes, response_object, status_of

from .errors import APIError
from .sent_text import SentText


class ResponseEventLog:
    """Turns one response's stored stream entries into its numbered stream events."""

    def __init__(self, job: dict[str, Any], doc: dict[str, Any]):
        self.job, self.doc = job, doc
        self.shapes = EventShapes(job["id"])
        self.next_number = 0
        self.text = SentText()
        self.opened = False
        self.over = False

    def _number(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for ev in events:
            ev["sequence_number"] = self.next_number
            self.next_number += 1
        return events

    def start(self) -> list[dict[str, Any]]:
        accepted = "in_progress" if not self.doc.get("background") else "queued"
        return self._number([self.shapes.lifecycle(
            "response.created", response_object(self.job, self.doc, status=accepted))])

    def feed(self, kind: str, data: dict[str, Any]) -> list[dict[str, Any]]:
        """The events one stream entry gives (none once the stream is over)."""
        if self.over:
            return []
        try:
            if kind == EVENT_RESET:
                self.text.reset()
                return []
            if kind == EVENT_TOKEN:
                out = self._open()
                if piece := self.text.piece(data.get("text", "")):
                    out.append(self.shapes.delta(piece))
                return self._number(out)
            if kind == EVENT_DONE:
                return self._number(self._end(data))
        except APIError as err:   # the re-run diverged from what was sent
            self.over = True
            return self._number([self.shapes.error(err.code or "stream_diverged", err.message)])
        return []

    def _open(self) -> list[dict[str, Any]]:
        if self.opened:
            return []
        self.opened = True
        return [self.shapes.lifecycle(
                    "response.in_progress",
                    response_object(self.job, self.doc, status="in_progress")),
                self.shapes.item_added(), self.shapes.part_added()]

    def _end(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        self.over = True
        status = status_of(job)[0]
        text = job.get("text") or ""
        out: list[dict[str, Any]] = []
        if text or status in ("completed", "incomplete"):
            out += self._open()
        if self.opened:
            if rest := self.text.rest(text):
                out.append(self.shapes.delta(rest))
            out += [self.shapes.text_done(text), self.shapes.part_done(text),
                    self.shapes.item_done(text, status)]
        out.append(self.shapes.lifecycle(TERMINAL_EVENTS[status],
                                         response_object(job, self.doc)))
        return out
