"""Helpers for the model-worker tests: build an in-process TransformersBackend and drive its steps by hand.

No engine, no Redis, no second process: the tests hand StepRequests to TransformersBackend.step directly,
the way the model executor does over its pipe, so they see exactly what the batch (KV cache,
masks, positions, sampler) does.
"""
from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field

import torch

from common.protocol import SamplingParams
from worker.messages import NewSequence, StepRequest
from worker.model_manager import ModelManager
from worker.model.transformers.backend import TransformersBackend
from worker.model.sampler import Sampler

GREEDY = SamplingParams(temperature=0.0)

_MODELS: dict[str, tuple] = {}


def load_model(model_dir: str):
    """(model, info) on cpu/float32, loaded once per test session (loading is the slow part)."""
    if model_dir not in _MODELS:
        _MODELS[model_dir] = ModelManager(model_dir).load_model("cpu", "float32")
    return _MODELS[model_dir]


_ON_DEVICE: dict[tuple[int, str], tuple] = {}


def on_device(model, info, device: str):
    """(model, info) on `device`: as given on the CPU, else a copy moved there (once per
    model and device)."""
    if device == "cpu":
        return model, info
    key = (id(model), device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = (copy.deepcopy(model).to(device),
                           dataclasses.replace(info, device=device))
    return _ON_DEVICE[key]


def make_worker(model_dir: str, max_num_seqs: int = 32) -> TransformersBackend:
    """A fresh TransformersBackend (empty KV cache, no sequences) over the session's loaded model."""
    model, info = load_model(model_dir)
    return TransformersBackend(model, info, max_num_seqs)


def sharpened(model, scale: float = 8.0):
    """A copy of a random model whose next token depends on the whole context.

    A freshly initialised tiny Llama with tied embeddings mostly predicts its *last input
    token* again (the token's own embedding dominates the residual stream), so its greedy
    tokens barely depend on attention: a padding or masking bug could leave them unchanged.
    Scaling up the attention and MLP weights lets the layers dominate the residual stream, and
    greedy decoding then walks through many different tokens.
    """
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            # (a model a TransformersBackend has run has q/k/v and gate/up fused: LlamaForward)
            if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj",
                                           "qkv_proj", "gate_up_proj"):
                p.mul_(scale)
    return m


def make_prompts(n: int, lengths=None, vocab: int = 49152, seed: int = 1234) -> list[list[int]]:
    """n prompts of distinct lengths (default: spread over 3..120, shuffled), random ids that
    avoid the special tokens at the start of the vocabulary."""
    rng = random.Random(seed)
    if lengths is None:
        lengths = rng.sample(range(4, 120), n - 2) + [3, 120]
        rng.shuffle(lengths)
    return [[rng.randrange(100, vocab) for _ in range(length)] for length in lengths]


def new_seq(seq_id: str, token_ids: list[int], params: SamplingParams = GREEDY,
            stop_token_ids=()) -> NewSequence:
    return NewSequence(seq_id, list(token_ids), params, stop_token_ids=tuple(stop_token_ids))


# --- driving the worker -------------------------------------------------------------------------
@dataclass
class Driver:
    """Drives a TransformersBackend by hand: joins, decodes and frees sequences step by step.

    Every step decodes all running sequences but the ones being freed (what the worker
    requires), then prefills the newcomers, as TransformersBackend.step orders them. `history` keeps,
    per step, who was decoded / prefilled / freed and the cache's row order afterwards.
    """

    worker: TransformersBackend
    outputs: dict[str, list[int]] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)

    def step(self, prefill=(), free=()) -> dict[str, int]:
        prefill, free = list(prefill), list(free)
        decode = [s for s in self.running if s not in free]
        res = self.worker.step(StepRequest(prefill=prefill, decode_seq_ids=decode,
                                           free_seq_ids=free))
        assert not res.errors, res.errors
        assert set(res.token_ids) == set(decode) | {s.seq_id for s in prefill}
        self.running = decode + [s.seq_id for s in prefill]
        for seq in prefill:
            self.outputs[seq.seq_id] = []
        for sid, tok in res.token_ids.items():
            self.outputs[sid].append(tok)
        # The worker's cache holds exactly the running sequences, each once.
        assert sorted(self.worker.cache.seq_ids) == sorted(self.running)
        self.history.append({"decode": decode, "prefill": [s.seq_id for s in prefill],
                             "free": free, "rows": list(self.worker.cache.seq_ids)})
        return res.token_ids

    def finish(self) -> None:
        """Frees everything still running (a step with nothing left to decode)."""
        if self.running:
            self.step(free=list(self.running))
        assert self.worker.cache.num_rows == 0

    def row_moves(self) -> int:
        """How many times a running sequence changed rows (a freed row refilled by the last)."""
        moves, last = 0, {}
        for h in self.history:
            rows = {sid: i for i, sid in enumerate(h["rows"])}
            moves += sum(1 for sid, i in rows.items() if sid in last and last[sid] != i)
            last = rows
        return moves


def run_steps(step, prompts: dict[str, tuple[list[int], SamplingParams]], n: int,
              join_at: dict | None = None) -> dict[str, list[int]]:
    """n tokens for each prompt through `step` (a backend's step, or an executor's execute),
    the way the engine drives it: newcomers join at their step of join_at (0 unless given),
    those done are freed; every sequence left is freed at the end."""
    join_at = join_at or {}
    out: dict[str, list[int]] = {sid: [] for sid in prompts}
    live: list[str] = []
    i = 0
    while any(len(v) < n for v in out.values()):
        new = [NewSequence(sid, ids, p) for sid, (ids, p) in prompts.items()
               if join_at.get(sid, 0) == i]
        done = [sid for sid in live if len(out[sid]) >= n]
        live = [sid for sid in live if sid not in done]
        res = step(StepRequest(prefill=new, decode_seq_ids=list(live), free_seq_ids=done))
        assert not res.errors, res.errors
        for sid, t in res.token_ids.items():
            out[sid].append(t)
        live += [s.seq_id for s in new]
        i += 1
        assert i < 10 * n + 10, "the backend stopped answering"
    step(StepRequest(free_seq_ids=live))
    return out


def run_batch(worker: TransformersBackend, prompts: dict[str, list[int]], n_tokens: int,
              params: dict[str, SamplingParams] | None = None) -> dict[str, list[int]]:
    """All prompts prefilled together in one step, then n_tokens - 1 decode steps."""
    params = params or {}
    d = Driver(worker)
    d.step(prefill=[new_seq(sid, ids, params.get(sid, GREEDY)) for sid, ids in prompts.items()])
    for _ in range(n_tokens - 1):
        d.step()
    d.finish()
    return d.outputs


def run_greedy(worker: TransformersBackend, prompts_ids: list[list[int]], n_tokens: int) -> list[list[int]]:
    """Greedy tokens of prompts decoded together as one batch, in prompt order."""
    out = run_batch(worker, {f"s{i}": ids for i, ids in enumerate(prompts_ids)}, n_tokens)
    return [out[f"s{i}"] for i in range(len(prompts_ids))]


def run_solo(worker: TransformersBackend, prompt_ids: list[int], n_tokens: int,
             params: SamplingParams = GREEDY) -> list[int]:
    """One prompt alone in the batch."""
    return run_batch(worker, {"solo": prompt_ids}, n_tokens, {"solo": params})["solo"]


def run_continuous(worker: TransformersBackend, prompts: dict[str, list[int]], targets: dict[str, int],
                   seed: int = 7, max_joins: int = 4) -> Driver:
    """Continuous batching: sequences join (in groups of 0..max_joins, while others decode)
    as rows free up, and each leaves once it has its target number of tokens, so rows are freed
    in the middle of the batch and refilled by the last one."""
    rng = random.Random(seed)
    queue = list(prompts)
    rng.shuffle(queue)
    d = Driver(worker)
    while queue or d.running:
        free = [s for s in d.running if len(d.outputs[s]) >= targets[s]]
        room = worker.cache.max_rows - (len(d.running) - len(free))
        k = min(room, rng.randint(0, max_joins), len(queue))
        if k == 0 and queue and len(d.running) == len(free):
            k = 1   # never an empty batch while work waits
        d.step(prefill=[new_seq(s, prompts[s]) for s in queue[:k]], free=free)
        queue = queue[k:]
    return d


# --- logits, for telling float noise from real differences ----------------------------------------
class RecordingSampler(Sampler):
    """The worker's sampler, also recording each sequence's next-token logits, step by step.

    Keeps the top-2 (ids and values) and every STRIDE-th logit, a fingerprint of the whole
    distribution small enough to keep for hundreds of steps.
    """

    STRIDE = 64

    def __init__(self, worker: TransformersBackend):
        super().__init__(worker.sampler.grammars)
        self.worker = worker
        self.steps: dict[str, list[dict]] = {}

    def sample(self, logits, states):
        by_state = {id(st): sid for sid, st in self.worker.states.items()}
        rec = logits.detach().float().clone()   # before sampling: penalties edit logits in place
        top = torch.topk(rec, 2, dim=-1)
        for i, st in enumerate(states):
            self.steps.setdefault(by_state[id(st)], []).append({
                "top2_ids": top.indices[i].tolist(), "top2": top.values[i].tolist(),
                "fingerprint": rec[i, ::self.STRIDE].clone()})
        return super().sample(logits, states)


def recording(worker: TransformersBackend) -> RecordingSampler:
    """Makes the worker record its logits; returns the recorder."""
    worker.sampler = RecordingSampler(worker)
    return worker.sampler


MEASURED = {"max_logit_diff": 0.0, "compared_steps": 0}   # over every compare_to_solo call


@dataclass
class SoloRun:
    tokens: list[int]
    steps: list[dict]   # RecordingSampler records, one per token


def solo_references(model, info, prompts: dict[str, list[int]],
                    n_tokens: int | dict[str, int], **worker_kw) -> dict[str, SoloRun]:
    """Each prompt run alone (greedy) in a fresh worker (TransformersBackend's `worker_kw`), with its
    logits recorded (n_tokens: for all, or per prompt)."""
    worker = TransformersBackend(model, info, 1, **worker_kw)
    rec = recording(worker)
    out = {}
    for sid, ids in prompts.items():
        rec.steps = {}
        tokens = run_solo(worker, ids, n_tokens if isinstance(n_tokens, int) else n_tokens[sid])
        out[sid] = SoloRun(tokens, rec.steps["solo"])
    return out


def compare_to_solo(sid: str, solo: SoloRun, tokens: list[int], steps: list[dict],
                    tol: float) -> dict | None:
    """Checks one batched sequence against its solo run.

    Returns None when its tokens equal the solo run's (and its logits stayed within `tol` of
    the solo logits at every step). If the tokens differ, the first divergence must be a near
    tie: the solo run's top-2 logits there within `tol` of each other, and the batch took the
    other one of the two; the measurements there are returned. Anything else fails.
    """
    ref = solo.tokens[:len(tokens)]
    assert len(ref) == len(tokens) == len(steps), (sid, len(ref), len(tokens), len(steps))
    j = next((i for i, (a, b) in enumerate(zip(ref, tokens)) if a != b), None)
    # Logits are comparable up to (and including) the first divergence: same context there.
    for k in range(len(tokens) if j is None else j + 1):
        diff = float((steps[k]["fingerprint"] - solo.steps[k]["fingerprint"]).abs().max())
        MEASURED["max_logit_diff"] = max(MEASURED["max_logit_diff"], diff)
        MEASURED["compared_steps"] += 1
        assert diff <= tol, f"{sid}: logits at token {k} differ from the solo run's by {diff}"
    if j is None:
        return None
    s = solo.steps[j]
    tie = {"seq": sid, "token_index": j, "solo_token": ref[j], "batch_token": tokens[j],
           "solo_top2_ids": s["top2_ids"], "solo_top2_gap": s["top2"][0] - s["top2"][1]}
    assert tie["solo_top2_gap"] <= tol and {ref[j], tokens[j]} == set(s["top2_ids"]), (
        f"{sid}: tokens diverge from the solo run at token {j} without a near tie: {tie}")
    return tie


@torch.inference_mode()
def plain_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Next-token logits of one unpadded sequence by a plain forward pass, no cache at all."""
    return model(input_ids=torch.tensor([token_ids], device=model.device),
                 use_cache=False).logits[0, -1].float()
