"""The served LoRA adapters, name -> folder, in one place for every ingress replica.

:class:`LoRARegistry` is a small Serve deployment of one replica (``cluster.app.build_app`` binds
it when ``engine.enable_lora`` is on, and hands its handle to every ``OpenAIIngress``). It holds
the adapters given at start (``lora_modules``) and those loaded at run time
(``POST /v1/load_lora_adapter``), and nothing else: no files are read here.

Why a deployment of its own, and not each ingress's memory, Ray's internal KV store or a detached
named actor:

* several ingress replicas must agree: a load through one is seen by the others. One replica that
  owns the mapping makes a name's add and remove atomic (its methods do not await), so two loads
  of one name through two ingresses cannot both succeed;
* Serve owns its lifetime: it starts and stops with the application (a detached actor would
  outlive a deleted app and hand its adapters to the next app of that name), is restarted by
  Serve if it dies, and is reached through an ordinary ``DeploymentHandle``. Ray's internal KV is
  a private API, and it too outlives the app;
* the cost is one handle call per registry read, which the ingress caches
  (:class:`router.lora.adapters.Adapters`): a request naming a known adapter makes no call.

What it does not hold: which replica has which adapter. Every request carries its adapter's
``LoRARequest(name, 0, path)``, and a replica loads it on first use, so a replica that starts
later (a restart, autoscaling) serves runtime-loaded adapters without any replay. If this replica
dies, Serve starts it again with the ``lora_modules`` alone: adapters loaded at run time must be
loaded again (docs/lora.md).
"""

from __future__ import annotations

import time

Version = tuple[int, int]
"""A registry state's version: ``(the registry replica's start, ns since the epoch; changes since)``.
Ordered: a later state of one registry replica, or any state of one started later (Serve
restarted it), is greater."""


class LoRARegistry:
    """Serve deployment body: the served adapters' names and folders.

    Args:
        modules: the adapters served from the start (``IngressConfig.lora_modules``), name ->
            absolute folder.

    Every answer carries the state's :data:`Version`, so that an ingress can tell a stale copy
    from a fresher one, whatever order its calls' answers come back in.
    """

    def __init__(self, modules: dict[str, str]) -> None:
        self._adapters: dict[str, str] = dict(modules)
        self._started = time.time_ns()
        self._changes = 0

    @property
    def _version(self) -> Version:
        return (self._started, self._changes)

    async def snapshot(self) -> tuple[Version, dict[str, str]]:
        """``(version, {name: folder})``: every adapter served now."""
        return self._version, dict(self._adapters)

    async def add(self, name: str, path: str) -> tuple[bool, Version, dict[str, str]]:
        """Serve the adapter in ``path`` as ``name`` unless that name is taken.

        Returns ``(added, version, adapters)``: ``added`` False when ``name`` was already served
        (nothing changed); the snapshot after the call either way."""
        added = name not in self._adapters
        if added:
            self._adapters[name] = path
            self._changes += 1
        return added, self._version, dict(self._adapters)

    async def remove(self, name: str) -> tuple[str | None, Version, dict[str, str]]:
        """Stop serving ``name``. Returns ``(folder, version, adapters)``: the folder it was served
        from, None when no adapter had that name; the snapshot after the call."""
        path = self._adapters.pop(name, None)
        if path is not None:
            self._changes += 1
        return path, self._version, dict(self._adapters)
