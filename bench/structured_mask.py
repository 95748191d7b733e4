"""Per-step cost of a structured-output token mask at batch 64: xgrammar against llguidance.

Each library compiles one JSON schema for the default model's tokenizer (llguidance also with
its rows filled one after another in one thread, instead of its parallel executor), then steps
64 matchers (each at its own place in its own object) for a number of steps: fill every row's
bitmask, apply it to random logits, take the best allowed token, advance. Prints milliseconds
per step for the fill and for the apply (llmq's own unpacking, the one the sampler uses).
xgrammar is measured when it is importable (it is not a dependency of llmq).

    python -m bench.structured_mask [--steps 200] [--batch 64]
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}


def _llguidance(tok, vocab: int, batch: int, serial: bool = False):
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    setup = time.perf_counter() - t0
    executor = llguidance.LLExecutor()
    words = (vocab + 31) // 32
    bitmask = torch.zeros((batch, words), dtype=torch.int32)

    def fill():
        if serial:   # one row after another in this thread
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * words * 4, words * 4)
            return
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                         bitmask.data_ptr(), words * 4, batch)

    def advance(i, token):
        m = matchers[i]
        m.consume_token(token)
        if m.is_stopped() or m.is_error():
            m.reset()

    return setup, bitmask, fill, advance


def _xgrammar(tok, vocab: int, batch: int):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    setup = time.perf_counter() - t0
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batcher = xgr.BatchGrammarMatcher()

    def fill():
        batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(i, token):
        m = matchers[i]
        if not m.accept_token(token) or m.is_terminated():
            m.reset()

    return setup, bitmask, fill, advance


def measure(name: str, build, tok, vocab: int, batch: int, steps: int) -> dict:
    from worker.model.structured_output import apply_bitmask

    setup, bitmask, fill, advance = build(tok, vocab, batch)
    gen = torch.Generator().manual_seed(0)
    # Spread the matchers over their objects first, so rows are at different places.
    fill_s = apply_s = 0.0
    for step in range(steps + 50):
        logits = torch.randn((batch, vocab), generator=gen)
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        for i, tok_id in enumerate(logits.argmax(-1).tolist()):
            if step < 50 and i > step:   # stagger: row i starts after i steps
                continue
            advance(i, tok_id)
        if step >= 50:
            fill_s += t1 - t0
            apply_s += t2 - t1
    return {"library": name, "batch": batch, "steps": steps, "setup_s": round(setup, 3),
            "fill_ms_per_step": round(1000 * fill_s / steps, 3),
            "apply_ms_per_step": round(1000 * apply_s / steps, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    from worker.model_manager import ModelManager

    tok = ModelManager().load_tokenizer()
    vocab = len(tok)
    print(f"vocab {vocab}, batch {args.batch}, {args.steps} steps, torch threads "
          f"{torch.get_num_threads()}")
    serial = functools.partial(_llguidance, serial=True)
    for name, build in (("llguidance", _llguidance), ("llguidance-serial", serial),
                        ("xgrammar", _xgrammar)):
        try:
            print(json.dumps(measure(name, build, tok, vocab, args.batch, args.steps)))
        except ImportError as exc:
            print(json.dumps({"library": name, "skipped": str(exc)}))


if __name__ == "__main__":
    main()
