"""The quality guard of a lower-precision dtype: the same greedy tokens as float32.

Judged: bfloat16, float32 over a float16 KV cache (what LLMQ_KV_CACHE_DTYPE=auto gives a
float32 model on a CPU), int8 and int4 weights (LLMQ_QUANTIZATION), and int8 weights over the float16 cache (what a
float32 model runs with LLMQ_QUANTIZATION=int8 on a CPU), each against float32 with its own float32 cache and float weights.
The quantized weights serve every step of these runs, prefill and 16-row decode steps included,
where the worker takes them only at steps of one or two rows: the guard judges them on every
position, not only on those a small step would compute.

Sixteen short chat prompts (the README's Paris question first) run greedy through the model
worker in this process, once per dtype, all prompts as one batch, exactly `tokens` new tokens
each. Against float32, per prompt, over the positions up to float32's end of answer (its first
EOS, included; all of them when there is none):
  - positional: the fraction of positions holding the same token;
  - prefix: the fraction before the first divergence (after it, both continue from different
    texts, so later positions are not comparable);
  - teacher-forced: float32's own tokens fed to the other dtype (one prefill with prompt
    logprobs), the fraction of positions where that dtype's most likely next token is float32's
    greedy one. Each position is judged on the same text, so one near-tie does not turn every
    later position into a miss: the per-position agreement the guard's target is about.
The answers (text up to EOS) are compared too: the Paris answer must still say Paris. The
in-process decode rate of each dtype at the same batch is reported beside it.
"""
from __future__ import annotations

import gc
import time

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "What planet is known as the Red Planet?",
    "Write one sentence about cats.",
    "What is the largest ocean on Earth?",
    "How many days are in a leap year?",
    "What gas do plants absorb from the air?",
    "Name a famous painting by Leonardo da Vinci.",
    "What is the opposite of cold?",
    "Which language is spoken in Brazil?",
    "Suggest a name for a pet goldfish.",
]
TARGET = 0.95


# (model dtype, KV cache dtype, weights): float32 with its own float32 cache and float weights
# is the reference; the float16 cache that `auto` gives a float32 model on a CPU, bfloat16, the
# quantized weights and int8 over the float16 cache are judged against it.
VARIANTS = (("float32", "model", "none"), ("float32", "float16", "none"),
            ("bfloat16", "model", "none"), ("float32", "model", "int8"),
            ("float32", "model", "int4"), ("float32", "float16", "int8"))


def label(dtype: str, kv: str, quant: str = "none") -> str:
    return (dtype + ("" if kv == "model" else f", {kv} KV cache")
            + ("" if quant == "none" else f", {quant} weights"))


def quality_phase(tokens: int = 64, variants=VARIANTS, progress=print) -> dict:
    """Greedy tokens per (dtype, KV cache dtype); the first is the reference for the others."""
    names = {label(*v): v for v in variants}
    dtypes = list(names)
    ref_name = dtypes[0]
    runs = {ref_name: _greedy(*names[ref_name], tokens, progress)}
    ref = runs[ref_name]
    for d in dtypes[1:]:
        runs[d] = _greedy(*names[d], tokens, progress, score=ref)
    out = {"prompts": len(PROMPTS), "tokens": tokens, "reference": ref_name, "target": TARGET,
           "answers": {ref_name: ref["answers"][0]}, "decode_tokens_per_s":
           {d: r["decode_tokens_per_s"] for d, r in runs.items()}}
    for d in dtypes[1:]:
        cmp = compare(ref["tokens"], runs[d]["tokens"], ref["eos"])
        cmp["answers_unchanged"] = sum(a == b for a, b in zip(ref["answers"], runs[d]["answers"]))
        cmp["paris_answer"] = runs[d]["answers"][0]
        cmp["paris_ok"] = "paris" in runs[d]["answers"][0].lower()
        cmp["teacher_forced_match"] = runs[d]["teacher_forced_match"]
        cmp["passed"] = cmp["teacher_forced_match"] >= TARGET and cmp["paris_ok"]
        cmp["speedup"] = round(runs[d]["decode_tokens_per_s"] / ref["decode_tokens_per_s"], 2)
        out[d] = cmp
        progress(f"quality: {d} vs {ref_name}: {cmp['teacher_forced_match']:.1%} of positions "
                 f"teacher-forced, {cmp['prefix_match']:.1%} until the "
                 f"first divergence, {cmp['positional_match']:.1%} positional, "
                 f"{cmp['answers_unchanged']}/{len(PROMPTS)} answers unchanged, Paris "
                 f"{'kept' if cmp['paris_ok'] else 'LOST'} ({cmp['paris_answer'][:60]!r}); "
                 f"in-process decode {cmp['speedup']}x "
                 f"-> {'PASS' if cmp['passed'] else 'FAIL'} (target {TARGET:.0%})")
    return out


def compare(ref: list[list[int]], other: list[list[int]], eos: set[int]) -> dict:
    """Match fractions of `other` against `ref`, over ref's positions up to its first EOS."""
    positions = same = prefix = 0
    for r, o in zip(ref, other):
        n = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        hits = [a == b for a, b in zip(r[:n], o[:n])]
        positions += n
        same += sum(hits)
        prefix += hits.index(False) if False in hits else len(hits)
    return {"positions": positions, "positional_match": round(same / max(1, positions), 4),
            "prefix_match": round(prefix / max(1, positions), 4)}


def _greedy(dtype: str, kv: str, quant: str, tokens: int, progress, score: dict | None = None
            ) -> dict:
    """All prompts as one batch through a fresh model worker in `dtype` with a `kv` KV cache
    and `quant` weights (at every step); with `score` (the reference run), also how often this one's argmax agrees with the
    reference's tokens."""
    from common.protocol import SamplingParams
    from common.settings import Settings
    from worker.messages import NewSequence, StepRequest
    from worker.model_manager import ModelManager
    from worker.model.transformers.backend import TransformersBackend
    from worker.model.transformers.quantized_linear import set_max_rows

    settings = Settings.from_env().replace(device="cpu", dtype=dtype, max_num_seqs=len(PROMPTS),
                                           kv_cache_mb=256, prefix_cache_mb=0,
                                           kv_cache_dtype=kv, quantization=quant)
    if settings.torch_threads > 0:   # as the model process does (model_worker.main)
        import torch

        torch.set_num_threads(settings.torch_threads)
    t = time.perf_counter()
    worker = TransformersBackend.load(settings)
    set_max_rows(worker.model, 1 << 30)
    tok = ModelManager.from_settings(settings).load_tokenizer()
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0)
    seqs = [NewSequence(f"q{i}", list(p), greedy) for i, p in enumerate(ids)]
    out = {s.seq_id: [] for s in seqs}

    def take(res) -> None:
        for sid, t_id in res.token_ids.items():
            out[sid].append(t_id)

    take(worker.step(StepRequest(prefill=seqs), early=take))
    t0 = time.perf_counter()
    for _ in range(tokens - 1):
        take(worker.step(StepRequest(decode_seq_ids=list(out))))
    rate = len(seqs) * (tokens - 1) / (time.perf_counter() - t0)
    eos = set(worker.info.eos_token_ids)
    got = [out[s.seq_id] for s in seqs]
    answers = [tok.decode(g[:next((i for i, x in enumerate(g) if x in eos), len(g))],
                          skip_special_tokens=True).strip() for g in got]
    progress(f"quality: {label(dtype, kv, quant)}: {len(seqs)} prompts x {tokens} tokens in "
             f"{time.perf_counter() - t:.1f} s (load included), decode {rate:.0f} tok/s")
    result = {"tokens": got, "answers": answers, "eos": eos,
              "decode_tokens_per_s": round(rate, 1)}
    if score is not None:
        result["teacher_forced_match"] = _teacher_forced(worker, ids, score, list(out))
    del worker
    gc.collect()
    return result


def _teacher_forced(worker, prompts: list[list[int]], ref: dict, free: list[str]) -> float:
    """The fraction of ref's answer positions (up to its first EOS) where this worker's most
    likely next token, given ref's text so far, is ref's token: rank 1 in its prompt logprobs."""
    from common.protocol import SamplingParams
    from worker.messages import NewSequence, StepRequest

    scoring = SamplingParams(temperature=0.0, prompt_logprobs=0)
    seqs, spans = [], {}
    for i, (p, r) in enumerate(zip(prompts, ref["tokens"])):
        n = next((j + 1 for j, t in enumerate(r) if t in ref["eos"]), len(r))
        seqs.append(NewSequence(f"t{i}", list(p) + list(r[:n]), scoring))
        spans[f"t{i}"] = (len(p), n)
    lps: dict = {}

    def take(res) -> None:
        lps.update(res.prompt_logprobs)

    res = worker.step(StepRequest(prefill=seqs, free_seq_ids=free), early=take)
    if res.errors:
        raise RuntimeError(f"teacher-forced scoring failed: {res.errors}")
    take(res)
    # entry k of prompt_logprobs scores token k + 1, so ref's token j is entry len(p) - 1 + j
    hits = total = 0
    for sid, (start, n) in spans.items():
        ranks = [lp.rank for lp in lps[sid][start - 1:start - 1 + n]]
        hits += sum(r == 1 for r in ranks)
        total += n
    return round(hits / max(1, total), 4)
