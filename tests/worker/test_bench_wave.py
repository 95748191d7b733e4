"""bench.wave: the in-process c=64 wave steps every prompt to its token count, as the scheduler
would split the prompts, and frees every sequence."""
from __future__ import annotations

from factories import make_prompts, make_worker

from bench.wave import wave


def test_a_wave_gives_every_prompt_its_tokens_and_frees_them(tiny_model, tiny_model_dir):
    worker = make_worker(tiny_model_dir, max_num_seqs=8)
    prompts = make_prompts(8, lengths=[6] * 8)
    w = wave(worker, prompts, tokens=5, first=5)
    assert w["tokens"] == 8 * 5
    # The first five get a token from the prefill, the last three from the second step (beside
    # the first five's decodes): the last three need 4 more decode steps, then one to free them.
    assert w["decode_steps"] == 4
    assert worker.cache.num_rows == 0
