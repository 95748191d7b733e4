"""Stop strings found in streamed text, in time proportional to the new text alone."""
from __future__ import annotations


def _failure(pattern: str) -> list[int]:
    """KMP's failure table: for each prefix, the length of its longest proper border."""
    fail, k = [0] * len(pattern), 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringMatcher:
    """Knuth-Morris-Pratt over several patterns at once, fed one piece of text at a time.

    Each stop string keeps its matched length (the longest prefix of it that ends the text so
    far), so a new piece costs O(its length x the number of stop strings) however much text is
    held back: rescanning the held text at every token let one request's long stop strings
    slow every step of the batch (15 ms per token per sequence at 16 x 5,000 characters).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.fails = [_failure(s) for s in self.stops]
        self.matched = [0] * len(self.stops)

    @property
    def held(self) -> int:
        """How many characters at the end of the text may still begin a stop string."""
        return max(self.matched, default=0)

    def feed(self, text: str, stop: bool = True) -> tuple[int, int] | None:
        """Reads `text`; at the first stop string it completes, returns (the index in `text`
        just past it, its length); the sequence then ends and nothing more is fed. When several
        end at the same character, the longest (the one that began first) wins. `stop` False
        (before min_tokens): reads all of `text`, matching on, and reports nothing, so a stop
        string that begins now and ends after min_tokens is still found."""
        hit: tuple[int, int] | None = None
        for k, s in enumerate(self.stops):
            end = self._feed_one(k, s, text, stop)
            if end is not None and (hit is None or (end, -len(s)) < (hit[0], -hit[1])):
                hit = (end, len(s))
        return hit

    def _feed_one(self, k: int, s: str, text: str, stop: bool = True) -> int | None:
        """Advances stop string k over `text`; returns where it first completes, if it does
        (with `stop`; else it reads on past completions)."""
        m, start = self.matched[k], 0
        if m == 0:
            start = text.find(s[0])         # nothing of it can start before its first character
            if start < 0:
                return None                 # (the usual case: no part of it here)
        if s[m:m + len(text)] == text:      # the held match simply grows (both in C)
            m += len(text)
            self.matched[k] = m if m < len(s) else self.fails[k][m - 1]
            return len(text) if m == len(s) and stop else None
        fail = self.fails[k]
        for i in range(start, len(text)):   # KMP, a character at a time
            c = text[i]
            while m and s[m] != c:
                m = fail[m - 1]
            if s[m] == c:
                m += 1
                if m == len(s):
                    m = fail[m - 1]
                    if stop:
                        self.matched[k] = m
                        return i + 1
        self.matched[k] = m
        return None
