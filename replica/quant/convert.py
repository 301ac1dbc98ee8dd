"""AWQ and GPTQ checkpoints served as compressed-tensors ones: converted once, tensor by tensor,
by the ``compressed-tensors`` package's ``convert_checkpoint`` (its own ``AutoAWQConverter`` for
AutoAWQ's GEMM format; :class:`replica.quant.gptq.GPTQConverter` for GPTQ), into
``<cache>/models/<name>--<hash>-ct`` (``$CARPOOL_CACHE_DIR``, default ``~/.cache/carpool``; the
hash covers the folder's path and its files' sizes and times, so a changed checkpoint converts
again). The integers and scales are carried over as they are, so the converted checkpoint's
weights are the original's (``s * (q - z)``); :mod:`replica.quant.compressed` then computes them.
What is checked before any replica loads (bits, formats, versions) is in
:mod:`replica.quant.checkpoint`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from replica.config.engine_config import cache_dir
from replica.config.model_files import checkpoint_config

logger = logging.getLogger(__name__)

METHODS = ("awq", "gptq")


def as_compressed(model_path: str) -> str:
    """``model_path`` (a local folder), or, where its config.json quantizes it by AWQ or GPTQ, the
    folder of its compressed-tensors copy (converted here the first time; several replicas may
    start at once: one converts, the others wait on a file lock).

    Raises:
        ValueError: the conversion fails (a tensor the converter refuses, a missing partner
            tensor); the message names the checkpoint and what failed.
    """
    config = (checkpoint_config(model_path) or {}).get("quantization_config")
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method not in METHODS or not os.path.isdir(model_path):
        return model_path
    source = Path(model_path)
    target = cache_dir() / "models" / f"{source.resolve().name}--{_fingerprint(source)}-ct"
    if (target / "config.json").is_file():
        return str(target)
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return str(target)
        logger.info("converting the %s checkpoint %s into compressed-tensors at %s (once)", method, source, target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
        try:
            _convert(source, tmp, method, config)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _convert(source: Path, target: Path, method: str, config: dict) -> None:
    """``source`` (an AWQ or GPTQ checkpoint of ``config``) written to ``target`` as compressed-tensors."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.utils.safetensors_load import get_checkpoint_files, get_weight_map

    if method == "awq":
        from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

        converter = AutoAWQConverter.from_autoawq_config({**config, "version": str(config.get("version", "gemm")).lower()})
    else:
        from replica.quant.gptq import GPTQConverter

        converter = GPTQConverter(config, set(get_weight_map(get_checkpoint_files(str(source)))))
    from loguru import logger as package_logger

    package_logger.disable("compressed_tensors")  # its debug lines, one per file copied
    try:
        convert_checkpoint(str(source), str(target), converter, max_workers=1, device="cpu")
    except (ValueError, KeyError, RuntimeError) as exc:
        raise ValueError(f"{source}: its {method} checkpoint does not convert ({type(exc).__name__}: {exc})") from exc
    finally:
        package_logger.enable("compressed_tensors")


def _fingerprint(folder: Path) -> str:
    """A short hash of ``folder``'s absolute path and its files' names, sizes and modification times."""
    entries = [str(folder.resolve())]
    for path in sorted(folder.iterdir()):
        if path.is_file():
            stat = path.stat()
            entries.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:12]
