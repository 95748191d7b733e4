"""Helpers for the model-worker tests: build an in-process ModelWorker and drive its steps by hand.

No engine, no Redis: the tests speak StepRequests to ModelWorker.step directly, the way the
model executor does over its pipe, so they see exactly what the batch (KV cache, masks,
positions, sampler) does.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from common.protocol import SamplingParams
from worker.messages import NewSequence, StepRequest
from worker.model_manager import ModelManager
from worker.model_worker import ModelWorker
from worker.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0)

_MODELS: dict[str, tuple] = {}


def load_model(model_dir: str):
    """(model, info) on cpu/float32, loaded once per test session (loading is the slow part)."""
    if model_dir not in _MODELS:
        _MODELS[model_dir] = ModelManager(model_dir).load_model("cpu", "float32")
    return _MODELS[model_dir]


def make_worker(model_dir: str, max_num_seqs: int = 32) -> ModelWorker:
    """A fresh ModelWorker (empty KV cache and sampler state) over the shared model."""
    model, info = load_model(model_dir)
    return ModelWorker(model, info, max_num_seqs)


def sharpened(model, scale: float = 8.0):
    """A copy of a random model whose next token depends on the whole context.

    A freshly initialised tiny Llama with tied embeddings mostly predicts its *last input
    token* again (the residual stream is dominated by the token's own embedding), so its greedy
    tokens barely depend on attention, and a padding or masking bug could leave them unchanged.
    Scaling up the attention and MLP weights lets the layers dominate the residual stream.
    """
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"):
                p.mul_(scale)
    return m


class RecordingSampler(Sampler):
    """The worker's sampler, also recording each sequence's next-token logits, step by step.

    Keeps the top-2 (ids and values) and every STRIDE-th logit (a fingerprint of the whole
    distribution, small enough to keep for hundreds of steps).
    """

    STRIDE = 64

    def __init__(self, worker: ModelWorker):
        self.worker = worker
        self.steps: dict[str, list[dict]] = {}

    def __call__(self, logits, states):
        by_state = {id(st): sid for sid, st in self.worker.states.items()}
        rec = logits.detach().float().clone()   # before sampling: the sampler edits in place
        top = torch.topk(rec, 2, dim=-1)
        for i, st in enumerate(states):
            self.steps.setdefault(by_state[id(st)], []).append({
                "top2_ids": top.indices[i].tolist(), "top2": top.values[i].tolist(),
                "fingerprint": rec[i, ::self.STRIDE].clone()})
        return super().__call__(logits, states)


def recording(worker: ModelWorker) -> RecordingSampler:
    worker.sampler = RecordingSampler(worker)
    return worker.sampler


def make_prompts(n: int, lengths=None, vocab: int = 49152, seed: int = 1234) -> list[list[int]]:
    """n prompts of distinct lengths (default: spread from 3 to 120), random ids avoiding the
    special tokens at the start of the vocabulary."""
    rng = random.Random(seed)
    if lengths is None:
        lengths = sorted(rng.sample(range(4, 120), n - 2) + [3, 120])
        rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(length)] for length in lengths]


@dataclass
class Driver:
    """Drives a ModelWorker by hand: joins, decodes and frees sequences step by step.

    Every step decodes all running sequences (what the worker requires), after freeing the
    ones asked and before prefilling the newcomers, exactly as ModelWorker.step orders them.
    """

    worker: ModelWorker
    outputs: dict[str, list[int]] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    num_steps: int = 0

    def step(self, prefill: list[NewSequence] = (), free: list[str] = ()) -> dict[str, int]:
        free = list(free)
        decode = [s for s in self.running if s not in free]
        res = self.worker.step(StepRequest(prefill=list(prefill), decode_seq_ids=decode,
                                           free_seq_ids=free))
        assert not res.errors, res.errors
        expected = set(decode) | {s.seq_id for s in prefill}
        assert set(res.token_ids) == expected
        self.running = decode + [s.seq_id for s in prefill]
        for seq in prefill:
            self.outputs[seq.seq_id] = []
        for sid, tok in res.token_ids.items():
            self.outputs[sid].append(tok)
        self.num_steps += 1
        # The worker's cache holds exactly the running sequences, each once.
        assert sorted(self.worker.cache.seq_ids) == sorted(self.running)
        return res.token_ids

    def finish(self) -> None:
        """Frees everything still running (a step with no decode left)."""
        if self.running:
            self.worker.step(StepRequest(free_seq_ids=list(self.running)))
            self.running = []
        assert self.worker.cache.num_rows == 0


def new_seq(seq_id: str, token_ids: list[int], params: SamplingParams = GREEDY,
            stop_token_ids=()) -> NewSequence:
    return NewSequence(seq_id, list(token_ids), params, stop_token_ids=tuple(stop_token_ids))


def run_batch(worker: ModelWorker, prompts: dict[str, list[int]], n_tokens: int,
              params: dict[str, SamplingParams] | None = None) -> dict[str, list[int]]:
    """All prompts prefilled together in one step, then n_tokens - 1 decode steps."""
    params = params or {}
    d = Driver(worker)
    d.step(prefill=[new_seq(sid, ids, params.get(sid, GREEDY)) for sid, ids in prompts.items()])
    for _ in range(n_tokens - 1):
        d.step()
    d.finish()
    return d.outputs


def run_greedy(worker: ModelWorker, prompts_ids: list[list[int]], n_tokens: int) -> list[list[int]]:
    """Greedy tokens of prompts decoded together as one batch, in prompt order."""
    out = run_batch(worker, {f"s{i}": ids for i, ids in enumerate(prompts_ids)}, n_tokens)
    return [out[f"s{i}"] for i in range(len(prompts_ids))]


def run_solo(worker: ModelWorker, prompt_ids: list[int], n_tokens: int,
             params: SamplingParams = GREEDY) -> list[int]:
    """One prompt alone in the batch (the reference every batched run must match)."""
    return run_batch(worker, {"solo": prompt_ids}, n_tokens, {"solo": params})["solo"]


@torch.inference_mode()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Next-token logits of one unpadded sequence, by a plain forward pass (no cache at all)."""
    ids = torch.tensor([token_ids])
    return model(input_ids=ids, use_cache=False).logits[0, -1].float()


def check_same_or_near_tie(model, prompt: list[int], solo: list[int], batched: list[int],
                           tol: float) -> dict | None:
    """None when batched == solo. Otherwise the first divergence must be a near tie:
    the solo run's top-2 next-token logits there are within `tol` and the batch picked the
    other one of those two. Returns what was measured at the divergence (for the report);
    raises AssertionError when the difference is not explained by a near tie."""
    assert len(solo) == len(batched), (len(solo), len(batched))
    if solo == batched:
        return None
    j = next(i for i, (a, b) in enumerate(zip(solo, batched)) if a != b)
    logits = reference_logits(model, prompt + solo[:j])
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    info = {"step": j, "solo": solo[j], "batched": batched[j], "top2_ids": top.indices.tolist(),
            "top2_gap": gap}
    assert gap <= tol and {solo[j], batched[j]} == set(top.indices.tolist()), (
        f"outputs diverge at token {j} without a near tie: {info}")
    return info
