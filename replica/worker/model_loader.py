"""Load a model's folder (``replica.config.model_files`` finds or converts it) with transformers,
with our paged attention plugged in; pick the dtype; compute linear layers from a GGUF file's
quantized blocks (:func:`quantize_linears`).
"""

from __future__ import annotations

import logging

import torch

from replica.config.engine_config import check_dtype_name

logger = logging.getLogger(__name__)


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """The torch dtype of a dtype setting on ``device``; ``"auto"`` picks the fast 16-bit type
    where the device computes it well:

    * CUDA: bfloat16 where the GPU has it natively (Ampere and later), else float16;
    * CPU: bfloat16 when this CPU's oneDNN has a bf16 path (``torch.ops.mkldnn._is_mkldnn_bf16_supported``:
      AVX512BW/VL/DQ or AVX-NE-CONVERT; native with AVX512_BF16 or AMX), as vLLM's CPU backend
      recommends, or when Carpool's float32-accumulating linear kernel is built (AVX2 and FMA:
      :func:`replica.kernels.cpu_kernels.has_f32_gemv`, built or loaded here if no one did yet), which
      reads bf16 weights and skips torch's emulated bf16 matmuls (slower than float32 where the CPU
      has no native bf16; the measurements are in ``docs/bench/cpu-speed.md``). Else float32;
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
    from replica.kernels import cpu_kernels

    if cpu_kernels.load() and cpu_kernels.has_f32_gemv():  # load() caches its answer
        return torch.bfloat16
    return torch.float32


def load_model(path: str, *, dtype: torch.dtype, device: str, attn_implementation: str, tp_size: int = 1):
    """Load a causal LM from a local folder with ``attn_implementation``; eval mode, no grad. With
    ``tp_size`` > 1 (in a process group of that many ranks), sharded by transformers' own
    tensor-parallel plan (:func:`replica.worker.parallel.sharded`).

    Returns the transformers ``PreTrainedModel``.

    Raises:
        ValueError: the model's code cannot take ``attn_implementation`` (GPT-Neo looks its
            attention class up by name and raises ``KeyError``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        model = _from_pretrained(path, dtype, attn_implementation, tp_size)
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




def _from_pretrained(path: str, dtype: torch.dtype, attn_implementation: str, tp_size: int = 1):
    """transformers' ``from_pretrained`` (sharded over ``tp_size`` ranks where above 1). A
    compressed-tensors checkpoint missing a tensor the model needs, or with one of another shape
    (but packed zero points), is refused (transformers would initialize it at random, with a
    warning); what transformers leaves out of one (an asymmetric ``pack-quantized`` checkpoint's
    zero points, a converted GPTQ layer's input order) is read from its files after it
    (:func:`replica.quant.compressed_load.load_what_transformers_drops`); sharded, every quantized
    layer's compressed tensors are read whole from the files instead (transformers' plan cuts
    packed integers and their shape as if they were weights), and each rank cuts its part of the
    layer's blocks (:func:`replica.quant.compressed.quantize_from_compressed`).

    Raises:
        ValueError: a compressed-tensors checkpoint lacks tensors (the first five named) or has
            one of another shape than the model's.
    """
    from transformers import AutoModelForCausalLM

    from replica.config.model_files import checkpoint_config
    from replica.quant.checkpoint import NAME

    extra = {}
    if tp_size > 1:
        from replica.worker.parallel import sharded

        extra = sharded(tp_size)
    config = (checkpoint_config(path) or {}).get("quantization_config")
    if not (isinstance(config, dict) and config.get("quant_method") == NAME):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **extra)
    # Its load report would list each of those tensors (a filter, not a level: transformers runs
    # other checks where its logger's level is WARNING or above).
    report = logging.getLogger("transformers.modeling_utils")
    quiet = _WithoutLoadReport()
    report.addFilter(quiet)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, ignore_mismatched_sizes=True, output_loading_info=True,
            **extra,
        )
    finally:
        report.removeFilter(quiet)
    if info["missing_keys"]:
        raise ValueError(f"{path}: the checkpoint lacks {', '.join(sorted(info['missing_keys'])[:5])}")
    from replica.quant.compressed_load import load_what_transformers_drops, load_whole_compressed

    if tp_size > 1:
        load_whole_compressed(model, path, info["mismatched_keys"])
    else:
        load_what_transformers_drops(model, path, info["mismatched_keys"], info["unexpected_keys"])
    return model


class _WithoutLoadReport(logging.Filter):
    """Drops transformers' load report (its ``LOAD REPORT`` warning), which Carpool reads as loading info instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype, gguf_file: str | None = None, scheme: str | None = None) -> int:
    """Compute ``model``'s linear layers on Carpool's CPU block kernels; returns how many: from
    ``gguf_file``'s blocks (:func:`replica.quant.gguf_weights.quantize_from_gguf`), from a
    compressed-tensors checkpoint's integers (``scheme`` ``compressed-tensors`` or None:
    :func:`replica.quant.compressed.quantize_from_compressed`; with None, where the kernels do not
    run here, the package de-quantizes them at load instead), or quantized at load by ``scheme``
    (``int8`` or ``int4``: :func:`replica.quant.online.quantize_online`); 0 where there is none of these.
    Under tensor parallelism each layer computes its rank's part (``carpool_tp_part``).

    ``scheme`` fits the model: :func:`replica.quant.checkpoint.check_checkpoint` said so before
    it loaded (the model runner checks it).

    Raises:
        ValueError: ``dtype`` is neither bfloat16 nor float32 (the kernel's activations), or the
            kernel is not built for it on this CPU (it needs AVX512F, or AVX2 with FMA and F16C);
            what ``quantize_from_gguf`` or ``quantize_from_compressed`` refuses.
    """
    from replica.kernels import cpu_kernels
    from replica.quant.checkpoint import NAME as COMPRESSED
    from replica.quant.compressed import compressed_config
    from replica.quant.online import SCHEMES

    compressed = compressed_config(model) is not None
    if not gguf_file and not compressed and scheme not in SCHEMES:
        return 0
    name = "gguf" if gguf_file else COMPRESSED if compressed else scheme
    device = next(model.parameters()).device.type
    if compressed and device == "cuda":
        from replica.quant.compressed import quantize_from_compressed

        return quantize_from_compressed(model, dtype)  # int4 on tinygemm where it takes it, else de-quantized
    kernels = dtype in (torch.bfloat16, torch.float32) and device == "cpu" and bool(
        cpu_kernels.load() and cpu_kernels.has_block_gemv(dtype))
    if compressed and scheme is None and not kernels:
        from replica.quant.compressed import decompress_all

        logger.info("%s checkpoint: de-quantized to %s at load (the block kernels do not run here)", COMPRESSED, dtype)
        decompress_all(model)
        return 0
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantization {name} computes with bfloat16 or float32 activations, not {dtype}")
    if not kernels:
        raise ValueError(
            f"quantization {name} needs Carpool's CPU block kernels, which this CPU cannot run for {dtype} "
            "(they need AVX512F, or AVX2 with FMA and F16C): serve without --quantization"
        )
    if gguf_file:
        from replica.quant.gguf_weights import quantize_from_gguf

        return quantize_from_gguf(model, gguf_file)
    if compressed:
        from replica.quant.compressed import quantize_from_compressed

        return quantize_from_compressed(model, dtype)
    from replica.quant.online import quantize_online

    return quantize_online(model, scheme)
