"""The model worker: its own process, owning the model, the batch's KV cache and sampling.

It answers StepRequests from the model executor with sampled token ids. Being a separate
process, a crash or OOM here leaves the Celery worker (and its Redis bookkeeping) alive.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Callable

import torch
from transformers.cache_utils import DynamicCache

from common import logs

from . import messages
from .kv_cache import BatchKVCache
from .messages import NewSequence, Ready, Shutdown, StepRequest, StepResult
from .model_manager import ModelManager
from .packed_linear import pack_linears
from .prefix_cache import PrefixCache, PrefixMatch
from .sampler import Sampler, SamplingState, prompt_logprobs
from .structured_output import Grammars

log = logging.getLogger("llmq.model_worker")


class ModelWorker:
    """Runs prefill and batched decode steps of one model on one device."""

    def __init__(self, model, info, max_num_seqs: int, prefix_cache_bytes: int = 0):
        self.model = model
        self.info = info
        self.device = torch.device(info.device)
        self.pad_id = 0
        self.cache = BatchKVCache(max_rows=max_num_seqs)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.states: dict[str, SamplingState] = {}
        self.sampler = Sampler(Grammars(lambda: ModelManager(info.path).load_tokenizer(),
                                        info.eos_token_ids))

    @classmethod
    def load(cls, settings) -> "ModelWorker":
        model, info = ModelManager.from_settings(settings).load_model(settings.device, settings.dtype)
        if settings.packed_linears and info.device == "cpu":
            log.info("packed %d linear layers for oneDNN", pack_linears(model))
        if settings.max_model_len:
            info = dataclasses.replace(info, max_model_len=min(info.max_model_len,
                                                               settings.max_model_len))
        return cls(model, info, settings.max_num_seqs, settings.prefix_cache_mb << 20)

    @torch.inference_mode()
    def step(self, req: StepRequest, early: Callable[[StepResult], None] | None = None
             ) -> StepResult:
        """Frees, prefills the newcomers, then decodes the running batch. When both run, the
        newcomers' first tokens go out through `early` before the decode starts, so their time
        to first token does not include the batch's decode; they join the batch's cache after
        it (the decode covers exactly the rows that were running)."""
        res = StepResult()
        if req.free_seq_ids:
            self.cache.remove(req.free_seq_ids)
            for sid in req.free_seq_ids:
                self.states.pop(sid, None)
        t0 = time.perf_counter()
        # Prompt logprobs need the logits of every prompt position: no cached prefix for those.
        newcomers = [(s, self.prefix_cache.match(s.token_ids, s.params.cache_salt)
                      if s.params.prompt_logprobs is None else PrefixMatch(0, []))
                     for s in req.prefill]
        joining: list[_Prefilled] = []
        # A sequence that scores its prompt is prefilled alone: its pass keeps every position's
        # logits ([rows, length, vocab]), which for a whole group could take gigabytes.
        scoring = [[p] for p in newcomers if p[0].params.prompt_logprobs is not None]
        plain = [p for p in newcomers if p[0].params.prompt_logprobs is None]
        for group in length_groups(plain, key=lambda p: len(p[0].token_ids) - p[1].num_tokens
                                   ) + scoring:
            joining += self._prefill(group, res, sum(len(p.seqs) for p in joining))
        t1 = time.perf_counter()
        res.prefill_s = t1 - t0
        if early is not None and req.decode_seq_ids and (res.token_ids or res.errors):
            early(dataclasses.replace(res, partial=True))
            res = StepResult(prefill_s=res.prefill_s)
        if req.decode_seq_ids:
            self._decode(req.decode_seq_ids, res)
        res.decode_s = time.perf_counter() - t1
        for p in joining:
            self.cache.add(p.seq_ids, p.layers, p.mask, p.mask.sum(-1))
            for i, s in enumerate(p.seqs):
                if self.prefix_cache.enabled:   # _remember turns it off on a failure
                    self._remember(s, _row_kv(p.layers, i, p.mask[i].nonzero().squeeze(-1)))
        return res

    def _decode(self, seq_ids: list[str], res: StepResult) -> None:
        if set(seq_ids) != set(self.cache.seq_ids):
            raise RuntimeError(f"decode set {len(seq_ids)} differs from the cached batch {self.cache.num_rows}")
        order = self.cache.seq_ids
        states = [self.states[s] for s in order]
        input_ids = torch.tensor([[st.last_token_id] for st in states], device=self.device)
        attn, pos = self.cache.begin_decode()
        out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos,
                         cache=self.cache.cache, use_cache=True)
        self.cache.end_decode()
        self._sample(order, states, out.logits[:, -1, :], res)

    def _prefill(self, group: list[tuple[NewSequence, PrefixMatch]], res: StepResult,
                 num_joining: int) -> list["_Prefilled"]:
        try:
            return [self._prefill_group(group, res, num_joining)]
        except Exception as exc:  # noqa: BLE001 - isolate the poison sequence, keep the rest
            if len(group) == 1:
                res.errors[group[0][0].seq_id] = f"{type(exc).__name__}: {exc}"
                log.warning("prefill failed: %s", exc, extra={"seq_id": group[0][0].seq_id})
                return []
            done: list[_Prefilled] = []
            for item in group:
                done += self._prefill([item], res, num_joining + sum(len(p.seqs) for p in done))
            return done

    def _prefill_group(self, group: list[tuple[NewSequence, PrefixMatch]], res: StepResult,
                       num_joining: int) -> "_Prefilled":
        """One forward pass over the newcomers' uncached tokens, and their first tokens. Each
        row is laid out as [padding][cached prefix][padding][rest of the prompt]: the cached
        keys and values go in as the past, right-aligned; the rest is left-padded so its last
        column is the last prompt token; the mask hides both paddings and position ids count
        real tokens only. The rows join the batch's cache later, in step()."""
        seqs = [s for s, _m in group]
        longest = max(len(s.token_ids) for s in seqs)
        if longest > self.info.max_model_len:
            raise ValueError(f"prompt of {longest} tokens exceeds the model's context of "
                             f"{self.info.max_model_len}")
        if self.cache.num_rows + num_joining + len(seqs) > self.cache.max_rows:
            raise RuntimeError("batch is full")
        n, cached = len(seqs), [m.num_tokens for _s, m in group]
        past_len = max(cached)
        new_len = max(len(s.token_ids) - c for s, c in zip(seqs, cached))
        ids = torch.full((n, new_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, past_len + new_len), dtype=torch.long)
        for i, (s, c) in enumerate(zip(seqs, cached)):
            rest = s.token_ids[c:]
            ids[i, new_len - len(rest):] = torch.tensor(rest)
            mask[i, past_len - c:past_len] = 1
            mask[i, past_len + new_len - len(rest):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        cache = DynamicCache(ddp_cache_data=self._past(group, past_len)) if past_len else DynamicCache()
        want_prompt = [s.params.prompt_logprobs is not None for s in seqs]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                         use_cache=True, logits_to_keep=0 if any(want_prompt) else 1)
        cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        states = [SamplingState.create(s.params, s.token_ids, s.num_output_tokens,
                                       s.stop_token_ids, self.device) for s in seqs]
        self.states.update((s.seq_id, st) for s, st in zip(seqs, states))
        try:
            self._sample([s.seq_id for s in seqs], states, out.logits[:, -1, :], res)
        except Exception:
            # (e.g. a stop token id outside the vocabulary) nothing of this group is kept;
            # _prefill retries its members one by one or reports the error.
            for s in seqs:
                self.states.pop(s.seq_id, None)
            raise
        res.cached_tokens.update((s.seq_id, c) for s, c in zip(seqs, cached) if c)
        for i, s in enumerate(seqs):
            if want_prompt[i]:   # uncached: the row's last len(token_ids) columns are its own
                res.prompt_logprobs[s.seq_id] = prompt_logprobs(
                    out.logits[i, new_len - len(s.token_ids):], s.token_ids,
                    s.params.prompt_logprobs)
        return _Prefilled(seqs, cache.layers, mask)

    def _remember(self, seq: NewSequence, kv_of) -> None:
        try:
            self.prefix_cache.insert(seq.token_ids, seq.params.cache_salt, kv_of)
        except Exception as exc:  # noqa: BLE001 - a cache layout this does not handle: go without
            log.warning("prefix caching turned off: %s: %s", type(exc).__name__, exc)
            self.prefix_cache.enabled = False
            self.prefix_cache.clear()

    def _past(self, group, past_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The group's cached prefixes as one past: per layer (keys, values) [rows, heads,
        past_len, dim], each row's prefix right-aligned, zeros (masked) before it."""
        first = next(m for _s, m in group if m.num_tokens).blocks[0]
        layers, _two, heads, _b, dim = first.shape
        past = first.new_zeros(layers, 2, len(group), heads, past_len, dim)
        for i, (_s, m) in enumerate(group):
            if m.num_tokens:
                past[:, :, i, :, past_len - m.num_tokens:] = m.kv()
        return [(past[li, 0], past[li, 1]) for li in range(layers)]

    def _sample(self, seq_ids, states, logits, res: StepResult) -> None:
        tokens, logprobs = self.sampler.sample(logits, states)
        for sid, st, tok, lp in zip(seq_ids, states, tokens, logprobs):
            st.record(tok)
            res.token_ids[sid] = tok
            if lp is not None:
                res.logprobs[sid] = lp

    def warm_up(self) -> None:
        """One prefill and a few decode steps, so the first request meets warm kernels."""
        from common.protocol import SamplingParams

        warm = NewSequence("__warmup__", [1, 2, 3, 4], SamplingParams(temperature=0.0))
        self.step(StepRequest(prefill=[warm]))
        for _ in range(2):
            self.step(StepRequest(decode_seq_ids=["__warmup__"]))
        self.step(StepRequest(free_seq_ids=["__warmup__"]))


@dataclasses.dataclass
class _Prefilled:
    """A prefill group's rows, waiting to join the batch's cache at the end of the step."""

    seqs: list[NewSequence]
    layers: list            # the prefill cache's layers (keys, values per layer)
    mask: torch.Tensor      # [rows, columns]: which columns hold each row's real tokens

    @property
    def seq_ids(self) -> list[str]:
        return [s.seq_id for s in self.seqs]


def _row_kv(layers, row: int, cols: torch.Tensor):
    """kv_of(start, end) for PrefixCache.insert: the keys and values of prompt tokens
    start..end of one row of a prefill's cache, whose real tokens sit at columns `cols`."""
    def kv_of(start: int, end: int) -> torch.Tensor:
        c = cols[start:end]
        return torch.stack([torch.stack((l.keys[row, :, c], l.values[row, :, c])) for l in layers])
    return kv_of


def length_groups(items: list, max_padding: float = 0.25,
                  key=lambda s: len(s.token_ids)) -> list[list]:
    """Splits newcomers into prefill groups of similar length (`key`: the tokens a newcomer
    still needs computed): one left-padded forward pass per group, with padding at most
    `max_padding` of the real tokens (a 400-token prompt beside ten 20-token ones would
    otherwise cost eleven 400-token rows)."""
    groups: list[list] = []
    for item in sorted(items, key=key, reverse=True):
        g = groups[-1] if groups else None
        if g is not None:
            longest = key(g[0])
            real = sum(key(x) for x in g) + key(item)
            if longest * (len(g) + 1) <= (1 + max_padding) * real:
                g.append(item)
                continue
        groups.append([item])
    return groups


def _exit_at_once() -> None:
    """Ends the process without the interpreter's teardown: this process keeps nothing to
    save, and unwinding torch and transformers took ~2 s of every worker's shutdown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(conn, settings) -> None:
    """Entry point of the spawned process: load, warm up, then serve steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle
    if settings.device.startswith("cuda:") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.device.split(":", 1)[1]
        settings = settings.replace(device="cuda:0")
    logs.configure("model_worker")
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    from .backends import load_backend

    try:
        worker = load_backend(settings)   # transformers (default) or another engine
        worker.warm_up()
    except Exception as exc:  # noqa: BLE001 - tell the executor why, in words, then exit
        log.exception("model worker failed to load")
        conn.send_bytes(messages.encode(RuntimeError(f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(messages.encode(Ready(worker.info)))
    while True:
        try:
            msg = messages.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return   # the executor went away
        if isinstance(msg, Shutdown):
            if getattr(worker, "needs_teardown", False):
                return   # its exit hooks stop processes of its own (vLLM's engine core)
            _exit_at_once()
        try:
            result = worker.step(msg, early=lambda part: conn.send_bytes(messages.encode(part)))
        except Exception as exc:  # noqa: BLE001 - a broken batch: report it, the executor restarts us
            log.exception("step failed")
            conn.send_bytes(messages.encode(RuntimeError(f"{type(exc).__name__}: {exc}")))
            return
        conn.send_bytes(messages.encode(result))
