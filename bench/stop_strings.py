"""Stop strings, worst case: the engine's cost per token of one sequence whose stop strings keep
text held back (issue 23). One stop string matches the output so far ("a" x 5,000 then "X"),
so 5,000 characters stay held; 15 others never match. Each token then adds one "a".

    python -m bench.stop_strings [--stop-chars 5000] [--stops 16] [--tokens 200]

Reports milliseconds per token (`Sequence.add_text`, as the engine calls it once per token per
sequence). Run against an older tree with PYTHONPATH=<that tree> to compare.
"""
from __future__ import annotations

import argparse
import json
import time

from common.protocol import SamplingParams
from worker.sequence import Sequence


def per_token_ms(stop_chars: int, num_stops: int, tokens: int) -> float:
    stops = ["a" * stop_chars + "X"] + [chr(0x62 + k) * stop_chars for k in range(num_stops - 1)]
    seq = Sequence("s", [1], SamplingParams(max_tokens=10**6, stop=stops))
    seq.add_text("a" * stop_chars)          # hold `stop_chars` characters back
    assert len(seq.pending_text) == stop_chars and not seq.is_finished
    t0 = time.perf_counter()
    for _ in range(tokens):
        seq.add_text("a")
    return (time.perf_counter() - t0) * 1000 / tokens


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stop-chars", type=int, default=5000)
    p.add_argument("--stops", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    a = p.parse_args(argv)
    print(json.dumps({"stop_chars": a.stop_chars, "stops": a.stops,
                      "ms_per_token": round(per_token_ms(a.stop_chars, a.stops, a.tokens), 4)}))


if __name__ == "__main__":
    main()
