"""The LoRA adapters as one ingress sees them: which model ids are adapters, loading and unloading.

Owns: resolving a request's ``model`` to the :class:`~replica.protocol.lora_request.LoRARequest`
its replica requests carry (None for the base model; 404 ``model_not_found`` for anything else:
:meth:`Adapters.lora_request`); ``POST /v1/load_lora_adapter`` (:meth:`Adapters.load`) and
``POST /v1/unload_lora_adapter`` (:meth:`Adapters.unload`) with their checks; and the adapters'
cards in ``GET /v1/models`` (:meth:`Adapters.cards`).

The adapters live in the :class:`~router.lora.lora_registry.LoRARegistry` deployment, shared by every
ingress replica; each ingress keeps a copy at most :data:`REGISTRY_TTL_S` old, renewed in the
background, so a request naming a known adapter waits for nothing. A name missing from the copy
is looked up afresh before it is refused, so an adapter loaded through another ingress is served
here at once; one unloaded through another ingress may still be served here for up to
:data:`REGISTRY_TTL_S` seconds (its own unloads take effect here at once). A replica needs no
notice of a load: every request carries the adapter's folder, and the replica reads it on first
use (``LLMReplica.generate``).

Load checks, in order (each refusal a 400 naming the field, in OpenAI's error shape): LoRA is on
(``engine.enable_lora``); the name is not the served model's and not served already; the folder,
with symlinks and ``..`` resolved, is inside one of ``lora_dirs``; then a replica reads and checks
the adapter (``LLMReplica.check_lora``: files, format, rank, target modules and shapes). Only
then is the name added, atomically (two loads of one name: one wins, the other gets 400).
"""

# No "from __future__ import annotations", as in router/ingress.py.

import asyncio
import logging
import os
import time
from typing import Any, Optional

from ray.serve.handle import DeploymentHandle

from replica.protocol.lora_request import LoRARequest
from router.config import IngressConfig
from router.request.errors import replica_error
from router.request.protocol import LoadLoRAAdapterRequest, OpenAIError, UnloadLoRAAdapterRequest

logger = logging.getLogger(__name__)

REGISTRY_TTL_S = 1.0
"""How long an ingress trusts its copy of the registry (seconds): the longest an adapter unloaded
through another ingress may still be served through this one."""

REMOVE_TIMEOUT_S = 5.0
"""How long an unload waits for the replicas to forget the adapter (seconds; best effort)."""


def model_not_found(model: str, param: str = "model") -> OpenAIError:
    """The 404 for a model id that is neither the served model nor a served adapter (OpenAI's
    message for ``model``; an unload's names its ``lora_name``)."""
    if param == "model":
        return OpenAIError(f"The model `{model}` does not exist.", 404, param=param, code="model_not_found")
    return OpenAIError(f"{param}: no LoRA adapter named `{model}` is loaded", 404, param=param, code="model_not_found")


def inside_dirs(path: str, dirs: list[str]) -> Optional[str]:
    """``path`` with symlinks and ``..`` resolved (``os.path.realpath``) if that lies inside one of
    ``dirs`` (each resolved the same way; a directory itself counts as inside), else None."""
    real = os.path.realpath(path)
    for d in dirs:
        root = os.path.realpath(d)
        if os.path.commonpath([real, root]) == root:
            return real
    return None


class Adapters:
    """One ingress's view of the served adapters, and the load and unload endpoints' work.

    Args:
        registry: handle of the :class:`~router.lora.lora_registry.LoRARegistry` deployment; None when
            LoRA is off (``engine.enable_lora`` false): then only the base model is served.
        replica: handle of the ``LLMReplica`` deployment (``check_lora``, ``remove_lora``).
        config: ``lora_modules`` (the registry's start) and ``lora_dirs``.
        model_name: the served model's id (an adapter's ``parent``).
    """

    def __init__(
        self, registry: Optional[DeploymentHandle], replica: DeploymentHandle, config: IngressConfig, model_name: str
    ) -> None:
        self.registry = registry
        self.replica = replica
        self.model_name = model_name
        self.dirs = list(config.lora_dirs)
        self._adapters: dict[str, str] = dict(config.lora_modules) if registry is not None else {}
        self._version: tuple[int, int] = (0, -1)  # nothing read yet
        self._read_at = -float("inf")  # time.monotonic() of the copy
        self._renewal: Optional[asyncio.Task] = None

    @property
    def enabled(self) -> bool:
        """LoRA is on: adapters may be served."""
        return self.registry is not None

    # ---- the registry's copy ---------------------------------------------------------------------
    def _take(self, version: tuple[int, int], adapters: dict[str, str]) -> None:
        """Keep a registry answer unless a fresher one was kept already (answers may come back out
        of order)."""
        if tuple(version) >= self._version:
            self._version, self._adapters, self._read_at = tuple(version), dict(adapters), time.monotonic()

    async def _read(self) -> dict[str, str]:
        """Read the registry now and keep its answer (unless a fresher one is kept already)."""
        version, adapters = await self.registry.snapshot.remote()
        self._take(version, adapters)
        return self._adapters

    async def _renew(self) -> None:
        try:
            await self._read()
        finally:
            self._renewal = None

    async def adapters(self, fresh: bool = False) -> dict[str, str]:
        """``{name: folder}`` of the served adapters: the copy, renewed in the background once older
        than :data:`REGISTRY_TTL_S`; with ``fresh`` (and before the first read), read from the
        registry now. Empty when LoRA is off.

        Raises:
            OpenAIError: 503 when a read that is waited for fails (the registry is being restarted).
        """
        if self.registry is None:
            return {}
        if fresh or self._version[1] < 0:
            try:
                return await self._read()
            except Exception as exc:
                raise replica_error(exc) from None
        if time.monotonic() - self._read_at >= REGISTRY_TTL_S and self._renewal is None:
            self._renewal = asyncio.ensure_future(self._renew())
            self._renewal.add_done_callback(_log_failure)
        return self._adapters

    # ---- requests ---------------------------------------------------------------------------------
    async def lora_request(self, model: Optional[str], param: str = "model") -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names: None for the served model (or no model), a
        ``LoRARequest(name, 0, folder)`` for a served adapter.

        Raises:
            OpenAIError: 404 ``model_not_found`` (naming ``param``) for any other id.
        """
        if model is None or model == self.model_name:
            return None
        path = (await self.adapters()).get(model)
        if path is None and self.enabled:
            path = (await self.adapters(fresh=True)).get(model)
        if path is None:
            raise model_not_found(model, param)
        return LoRARequest(model, 0, path)

    def cards(self, adapters: dict[str, str], max_model_len: int) -> list[dict[str, Any]]:
        """The ``GET /v1/models`` cards of ``adapters`` (vLLM's: ``root`` the folder, ``parent``
        the served model's id), sorted by name."""
        return [
            {"id": name, "object": "model", "created": 0, "owned_by": "carpool", "root": path,
             "parent": self.model_name, "max_model_len": max_model_len}
            for name, path in sorted(adapters.items())
        ]

    # ---- load and unload -------------------------------------------------------------------------
    async def load(self, body: LoadLoRAAdapterRequest) -> dict[str, Any]:
        """``POST /v1/load_lora_adapter``: check the adapter (module docstring) and serve it.

        Returns ``{"name", "path", "rank", "target_modules"}`` (``path`` resolved), as the
        replica's ``check_lora`` reports it.

        Raises:
            OpenAIError: 400 naming ``lora_name`` or ``lora_path`` for every refusal; 503 when
                no replica can check it.
        """
        name = body.lora_name
        if self.registry is None:
            raise OpenAIError(
                "LoRA is not enabled on this server (start it with --enable-lora and --lora-dir)",
                param="lora_name", code="lora_not_enabled",
            )
        if name == self.model_name:
            raise OpenAIError(f"lora_name: {name!r} is the served model's name", param="lora_name", code="invalid_value")
        if name in await self.adapters(fresh=True):
            raise _already_loaded(name)
        if not self.dirs:
            raise OpenAIError(
                "lora_path: loading adapters at run time is off (start the server with --lora-dir DIR)",
                param="lora_path", code="invalid_value",
            )
        if not os.path.isabs(body.lora_path):
            raise OpenAIError(
                f"lora_path: {body.lora_path!r} is not an absolute path (a folder inside the server's --lora-dir)",
                param="lora_path", code="invalid_value",
            )
        path = inside_dirs(body.lora_path, self.dirs)
        if path is None:
            raise OpenAIError(
                f"lora_path: {body.lora_path!r} is outside the directories adapters may be loaded from "
                "(the server's --lora-dir)", param="lora_path", code="invalid_value",
            )
        request = LoRARequest(name, 0, path)
        try:
            info = await self.replica.check_lora.remote(request)
        except Exception as exc:
            error = replica_error(exc)
            if error.code == "invalid_lora_adapter":  # the folder is at fault, not a request's model
                error.param = "lora_path"
            raise error from None
        added, version, adapters = await self.registry.add.remote(name, path)
        self._take(version, adapters)
        if not added:
            raise _already_loaded(name)
        logger.info("LoRA adapter %r loaded from %s", name, path)
        return {"name": name, "path": path, "rank": info.get("rank"), "target_modules": info.get("target_modules")}

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        """``POST /v1/unload_lora_adapter``: stop serving the adapter (requests running with it
        finish with it), then ask every replica to forget it from host memory (best effort, up to
        :data:`REMOVE_TIMEOUT_S`). Returns the folder it was served from.

        Raises:
            OpenAIError: 404 ``model_not_found`` for a name that is not a served adapter; 400 for
                the served model's own name.
        """
        name = body.lora_name
        if name == self.model_name:
            raise OpenAIError(f"lora_name: {name!r} is the served model, not an adapter", param="lora_name", code="invalid_value")
        if self.registry is None:
            raise model_not_found(name, "lora_name")
        path, version, adapters = await self.registry.remove.remote(name)
        self._take(version, adapters)
        if path is None:
            raise model_not_found(name, "lora_name")
        try:
            await self.replica.broadcast("remove_lora", name).results_async(
                timeout_s=REMOVE_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # a replica gone or slow: it reads the adapter again only if asked
            logger.warning("unloading LoRA adapter %r: not every replica was told: %r", name, exc)
        logger.info("LoRA adapter %r unloaded", name)
        return path


def _already_loaded(name: str) -> OpenAIError:
    return OpenAIError(f"lora_name: the adapter {name!r} is already loaded", param="lora_name", code="invalid_value")


def _log_failure(task: asyncio.Future) -> None:
    """Log a background registry read that failed (the copy is kept meanwhile)."""
    if not task.cancelled() and task.exception() is not None:
        logger.warning("reading the LoRA registry failed: %r", task.exception())
