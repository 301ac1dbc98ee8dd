"""The LoRA admission rule: at most ``max_loras`` distinct adapters in the running batch (as
vLLM's scheduler): a waiting request of another adapter is passed over, keeping its place, until
an adapter's last running request leaves; it waits, it does not fail. Plain Python."""

from __future__ import annotations

from collections.abc import Iterable

from replica.core.request import Request


def running_loras(running: Iterable[Request]) -> list:
    """The distinct adapters (``Request.lora``, by identity) of ``running``, in order."""
    seen: dict[int, object] = {}
    for request in running:
        if request.lora is not None:
            seen.setdefault(id(request.lora), request.lora)
    return list(seen.values())


class LoRAAdmission:
    """One admission pass's view of the running adapters: O(running) to build, O(1) per
    :meth:`blocked` and :meth:`admit`. ``max_loras`` None: nothing is ever blocked."""

    def __init__(self, running: Iterable[Request], max_loras: int | None) -> None:
        self.max_loras = max_loras
        self.active = {id(lora) for lora in running_loras(running)} if max_loras is not None else set()

    def blocked(self, request: Request) -> bool:
        """Whether admitting ``request`` would run more than ``max_loras`` distinct adapters."""
        if request.lora is None or self.max_loras is None:
            return False
        return len(self.active) >= self.max_loras and id(request.lora) not in self.active

    def admit(self, request: Request) -> None:
        """``request`` joins the running batch."""
        if request.lora is not None and self.max_loras is not None:
            self.active.add(id(request.lora))
