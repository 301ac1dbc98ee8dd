"""AWQ and GPTQ checkpoints served as compressed-tensors ones: converted once, tensor by tensor,
by the ``compressed-tensors`` package's ``convert_checkpoint`` (its own ``AutoAWQConverter`` for
AutoAWQ's GEMM format; :class:`replica.quant.gptq.GPTQConverter` for GPTQ), into
``<cache>/models/<parent>--<name>--<hash>-ct`` (the checkpoint folder's last two path parts;
``$CARPOOL_CACHE_DIR``, default ``~/.cache/carpool``; the
hash covers the folder's path, its files' sizes and times and the converters' versions, so a
changed checkpoint converts again; the copy made before stays until removed). The integers and scales are carried over as they are, so the converted checkpoint's
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
    target = cache_dir() / "models" / f"{'--'.join(source.resolve().parts[-2:])}--{_fingerprint(source)}-ct"
    if (target / "config.json").is_file():
        logger.info("serving the %s checkpoint %s from its compressed-tensors copy %s", method, source, target)
        return str(target)
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():
            return str(target)
        prefix = f".converting-{target.name}-"
        for left in target.parent.glob(prefix + "*"):  # a conversion killed midway (this lock is held: none runs)
            shutil.rmtree(left, ignore_errors=True)
        logger.info("converting the %s checkpoint %s into compressed-tensors at %s (once)", method, source, target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=prefix))
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
    from loguru import logger as package_logger

    if not ((source / "model.safetensors").is_file() or (source / "model.safetensors.index.json").is_file()):
        raise ValueError(f"{source}: a {method} checkpoint is converted from model.safetensors (or its index), which it lacks")
    package_logger.disable("compressed_tensors")  # its debug lines, one per file copied
    try:
        if method == "awq":
            from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

            converter = AutoAWQConverter.from_autoawq_config({**config, "version": str(config.get("version", "gemm")).lower()})
        else:
            from replica.quant.gptq import GPTQConverter

            converter = GPTQConverter(config, set(get_weight_map(get_checkpoint_files(str(source)))))
        convert_checkpoint(str(source), str(target), converter, max_workers=1, device="cpu")
    except Exception as exc:  # noqa: BLE001 — the package's and safetensors' errors (a damaged file), said by name
        raise ValueError(f"{source}: its {method} checkpoint does not convert ({type(exc).__name__}: {exc})") from exc
    finally:
        package_logger.enable("compressed_tensors")


CONVERTER_VERSION = 1  # raised when a conversion changes: copies made before convert again


def _fingerprint(folder: Path) -> str:
    """A short hash of ``folder``'s absolute path, its files' names, sizes and modification times,
    :data:`CONVERTER_VERSION` and the ``compressed-tensors`` package's version."""
    from importlib.metadata import version

    entries = [str(folder.resolve()), str(CONVERTER_VERSION), version("compressed-tensors")]
    for path in sorted(folder.iterdir()):
        if path.is_file():
            stat = path.stat()
            entries.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:12]
