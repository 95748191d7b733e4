"""The quality guard's match fractions (bench/quality.py), over hand-made greedy tokens."""
from bench.quality import compare

EOS = {0}


def test_positions_count_up_to_the_references_first_eos():
    ref = [[5, 6, 0, 9, 9], [1, 2, 3, 4, 5]]
    same = [[5, 6, 0, 7, 7], [1, 2, 3, 4, 5]]   # differs only after the reference's EOS
    got = compare(ref, same, EOS)
    assert got == {"positions": 3 + 5, "positional_match": 1.0, "prefix_match": 1.0}


def test_prefix_stops_at_the_first_divergence_positional_does_not():
    ref = [[1, 2, 3, 4]]
    other = [[1, 9, 3, 4]]
    got = compare(ref, other, EOS)
    assert got["positional_match"] == 0.75
    assert got["prefix_match"] == 0.25


class _RankWorker:
    """A model worker whose argmax after any text is `best(text)`: prompt logprobs rank 1 where
    the next token is that, rank 2 elsewhere."""

    def __init__(self, best):
        self.best, self.requests = best, []

    def step(self, req, early=None):
        from worker.messages import StepResult, TokenLogprobs

        self.requests.append(req)
        res = StepResult()
        for s in req.prefill:
            ids = s.token_ids
            res.prompt_logprobs[s.seq_id] = [
                TokenLogprobs(logprob=0.0, rank=1 if ids[i] == self.best(ids[:i]) else 2)
                for i in range(1, len(ids))]
        return res


def test_teacher_forced_judges_each_answer_position_on_the_references_text():
    from bench.quality import _teacher_forced

    prompts = [[100, 101], [200]]
    ref = {"tokens": [[5, 6, 0, 9], [7, 8, 8]], "eos": EOS}   # answers: 5 6 0 | 7 8 8
    # agrees everywhere except after "200 7 8" (it would say 9, the reference says 8)
    worker = _RankWorker(lambda text: 9 if text == [200, 7, 8] else _ref_next(prompts, ref, text))
    got = _teacher_forced(worker, prompts, ref, free=["q0", "q1"])
    assert got == round(5 / 6, 4)   # 3 + 3 answer positions (up to the EOS), one miss
    assert worker.requests[0].free_seq_ids == ["q0", "q1"]   # the greedy rows go first


def _ref_next(prompts, ref, text):
    for p, r in zip(prompts, ref["tokens"]):
        full = p + r
        if full[:len(text)] == text and len(text) < len(full):
            return full[len(text)]
    return -1
