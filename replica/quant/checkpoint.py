"""What Carpool serves of a quantized checkpoint's config, checked without loading the model (and
without torch, for ``carpool serve`` before Ray starts; the ``compressed-tensors`` package, which
imports torch, only where the checkpoint is one): its ``quant_method`` (``compressed-tensors``;
``awq`` and ``gptq``, which :mod:`replica.quant.convert` rewrites as compressed-tensors; others,
such as bitsandbytes and FP8 checkpoints, are refused), the schemes of its config groups
(:func:`check_scheme`: integer weights of 4 or 8 bits per channel or per group, with int8 inputs
quantized per token, dynamic and symmetric, or weights alone), an AWQ or GPTQ config's bits and
format (:func:`check_awq_gptq`) and whether the ``quantization`` setting fits it.
:mod:`replica.quant.compressed` computes what passes.
"""

from __future__ import annotations

NAME = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
CONVERTED = ("awq", "gptq")  # served through a compressed-tensors copy (replica.quant.convert)
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")


def check_checkpoint(model: str, quantization: str | None, tensor_parallel_size: int) -> None:
    """Before any replica loads ``model`` (a local folder, or a hub id in the hub's local cache;
    others are checked where they load): raises ``ValueError`` where its config.json quantizes
    it by a method Carpool does not serve (AWQ,
    GPTQ, bitsandbytes, FP8, ...), where ``quantization`` does not fit it (``compressed-tensors``
    for a model that is no such checkpoint; ``gguf``, ``int8`` or ``int4`` for one that is), or
    where its schemes are refused (:func:`check_checkpoint_config`, at ``tensor_parallel_size``)."""
    from replica.config.model_files import checkpoint_config

    full = checkpoint_config(model)
    if full is None:
        return  # not readable here: the replica checks it before it loads the model
    config = full.get("quantization_config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{model}: config.json's quantization_config is {config!r}, not an object with a quant_method")
    method = config.get("quant_method")
    if method is None:
        if quantization in (NAME, *CONVERTED):
            raise ValueError(
                f"quantization {quantization} needs a checkpoint whose config.json has {_a(quantization)} quantization_config; "
                f"{model} has none"
            )
        return
    text = full.get("text_config") or {}
    tied = full.get("tie_word_embeddings", text.get("tie_word_embeddings")) is True
    if method in CONVERTED:
        if quantization not in (None, method):
            raise ValueError(f"the model is {_a(method)} checkpoint: serve it with quantization {method} (or unset), not {quantization}")
        check_awq_gptq(method, config, tied)
        return
    if method != NAME:
        raise ValueError(
            f"{model} is quantized by {method!r}, which Carpool does not serve yet ({NAME}, AWQ, GPTQ and GGUF checkpoints it does)"
        )
    if quantization not in (None, NAME):
        raise ValueError(f"the model is a {NAME} checkpoint: serve it with quantization {NAME} (or unset), not {quantization}")
    check_checkpoint_config(config, tied=tied, tensor_parallel_size=tensor_parallel_size)


def check_awq_gptq(method: str, config: dict, tied: bool = False) -> None:
    """Raises ``ValueError`` where an AWQ or GPTQ ``quantization_config`` (a dict) is not one
    :mod:`replica.quant.convert` converts: AWQ other than 4 bits with zero points in AutoAWQ's
    GEMM format (GEMV, ExLlama, IPEX and Marlin layouts are other packings; its GEMM layers
    always carry zero points); GPTQ other than 4 or 8 bits in the ``gptq``/``gptq_v2`` format,
    with per-module overrides (GPTQModel's ``dynamic``), or with a quantized ``lm_head`` that
    the model ties to its input embeddings (``tied``: transformers cannot load that)."""
    bits = config.get("bits", 4)
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"quantization awq: {bits}-bit {version} checkpoints are not served; 4-bit GEMM ones (AutoAWQ's default) are")
        if config.get("zero_point", True) is not True:
            raise ValueError("quantization awq: checkpoints without zero points (zero_point false) are not served; AutoAWQ's GEMM "
                             "layers carry them")
        return
    if tied and config.get("lm_head"):
        raise ValueError("quantization gptq: the checkpoint quantizes lm_head, which this model ties to its input embeddings; "
                         "transformers cannot load a tied output layer packed")
    fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
    if bits not in GPTQ_BITS or fmt not in GPTQ_FORMATS:
        raise ValueError(f"quantization gptq: {bits}-bit checkpoints in format {fmt} are not served; {GPTQ_BITS} bits in {GPTQ_FORMATS} are")
    if config.get("dynamic"):
        raise ValueError("quantization gptq: checkpoints with per-module overrides (dynamic) are not served yet")


def check_checkpoint_config(config: dict, tied: bool = False, tensor_parallel_size: int = 1) -> None:
    """Raises ``ValueError`` where a checkpoint's ``quantization_config`` (config.json's, as a dict)
    quantizes the KV cache, transforms weights, embeddings (``model.embed_tokens``, by class or
    name), the output layer of a model whose ``tied`` embeddings share it (transformers cannot
    load that: its tied weight is the packed ``lm_head.weight``), or has a scheme Carpool does not
    compute (naming the config group and its targets), or int8 inputs (W8A8) at a
    ``tensor_parallel_size`` above 1 (a row-wise layer's rank would quantize each token from its
    part of the inputs, not the whole: other integers than transformers'): what
    :func:`quantize_from_compressed` would refuse, said before any replica loads the model. Targets are matched as the package
    matches them (``is_match``)."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match

    try:
        parsed = QuantizationConfig.model_validate({k: v for k, v in config.items() if k in QuantizationConfig.model_fields})
    except ValueError as exc:  # pydantic's ValidationError
        first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"quantization {NAME}: the checkpoint's quantization_config does not read as one ({where}: {first['msg']})") from None
    for key in ("kv_cache_scheme", "transform_config"):
        if config.get(key):
            raise ValueError(f"quantization {NAME}: checkpoints with a {key} are not served yet")
    for group, scheme in parsed.config_groups.items():
        if scheme.format is None:
            scheme = scheme.model_copy(update={"format": parsed.format})
        said = f"config group {group} (targets {', '.join(scheme.targets)})"
        if is_match("model.embed_tokens", torch.nn.Embedding(1, 1), scheme.targets, parsed.ignore or ()):
            raise ValueError(f"quantization {NAME}: {said} quantizes embeddings; only linear layers are served quantized")
        if tied and is_match("lm_head", torch.nn.Linear(1, 1), scheme.targets, parsed.ignore or ()):
            raise ValueError(
                f"quantization {NAME}: {said} quantizes lm_head, which this model ties to its input embeddings; "
                "transformers cannot load a tied output layer packed (leave lm_head out: ignore it)"
            )
        check_scheme(said, scheme)
        if scheme.input_activations is not None and tensor_parallel_size > 1:
            raise ValueError(f"quantization {NAME}: {said} quantizes its input activations per token (W8A8), which runs at "
                             f"tensor_parallel_size 1 for now (got {tensor_parallel_size})")


def check_scheme(name: str, scheme) -> None:
    """Raises ``ValueError``, naming ``name`` (a layer or config group) and its scheme, where
    Carpool does not compute ``scheme`` (a compressed-tensors ``QuantizationScheme``)."""
    weights, inputs = scheme.weights, scheme.input_activations
    said = f"quantization {NAME}: {name}"
    fmt = getattr(scheme.format, "value", scheme.format)
    if weights is None or weights.type != "int" or weights.num_bits not in (4, 8) or fmt not in FORMATS:
        raise ValueError(
            f"{said} has weights {_describe(weights)} in format {fmt}; Carpool computes integer weights of 4 or 8 bits "
            f"({', '.join(FORMATS)})"
        )
    if weights.strategy not in ("channel", "group"):
        raise ValueError(f"{said}: weight scales per {weights.strategy} are not served; per channel or per group are")
    if scheme.output_activations is not None:
        raise ValueError(f"{said} quantizes its output activations; Carpool does not")
    if inputs is not None and not (
        inputs.type == "int" and inputs.num_bits == 8 and inputs.dynamic is True and inputs.symmetric
        and inputs.strategy == "token"
        and weights.num_bits == 8 and weights.symmetric
    ):
        raise ValueError(
            f"{said} quantizes its input activations as {_describe(inputs)}; Carpool computes int8 weights with "
            "int8 activations quantized per token, dynamic and symmetric (W8A8), or weights alone"
        )


def _a(word: str) -> str:
    """``word`` with its indefinite article ("an awq", "a gptq")."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _describe(args) -> str:
    if args is None:
        return "none"
    return (f"{args.type}{args.num_bits} {getattr(args.strategy, 'value', args.strategy)}"
            f"{' symmetric' if args.symmetric else ' asymmetric'}{' dynamic' if args.dynamic is True else ''}")
