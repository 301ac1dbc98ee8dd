"""The one place Carpool reaches into Ray Serve's private modules, checked against the Ray it runs on.

:func:`reuse_address_for_direct_ingress`: Serve's direct-ingress HTTP server (Ray Serve 2.60,
``ray.serve._private.http_util.start_asgi_http_server``) binds its listening socket without
``SO_REUSEADDR`` (which uvicorn and most servers set). An ingress replica that replaces another
on the same port (``carpool serve``'s direct ingress: one fixed port) then failed with EADDRINUSE
for about a minute after the old one closed its connections (they linger in TIME_WAIT), and
Serve then blocked the port for good. No public Serve API sets the option (``HTTPOptions`` has
none; Serve passes ``enable_so_reuseport=False`` itself), so the ``socket`` module that helper
reads is swapped for one whose ``socket()`` sets it.

That relies on private names, so it is applied only where :func:`direct_ingress_patch_problem`
finds none: Ray within :data:`CHECKED_RAY_VERSIONS`, the module importable, its ``socket``
global the standard module (or this patch's), and ``start_asgi_http_server`` present with the
keyword arguments Serve's replica passes and reading that global. Otherwise it logs a warning
naming what differs and leaves Serve as it is (the server still works; only a quick restart on
the same port may fail as above). ``tests/unit/test_ray_compat.py`` fails when the installed
Ray no longer matches, so an upgrade is checked before it ships.
"""

from __future__ import annotations

import inspect
import logging
import socket
import types
from typing import Any

logger = logging.getLogger(__name__)

# Ray versions whose Serve internals this module was checked against: [first, last) as (major, minor).
CHECKED_RAY_VERSIONS = ((2, 60), (2, 61))
PATCHED_MODULE = "ray.serve._private.http_util"
# The keyword arguments Serve's replica passes start_asgi_http_server (ray/serve/_private/replica.py).
SERVER_PARAMETERS = ("app", "http_options", "event_loop", "enable_so_reuseport")

_SHIM_MARK = "__carpool_reuse_address__"


def _ray_version() -> tuple[int, int] | None:
    """The installed Ray's ``(major, minor)``, or None when Ray or its version cannot be read."""
    try:
        import ray
    except ImportError:
        return None
    try:
        major, minor = (int(part) for part in ray.__version__.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def direct_ingress_patch_problem(http_util: Any = None, version: tuple[int, int] | None = None) -> str | None:
    """Why :func:`reuse_address_for_direct_ingress` cannot patch Serve here, or None when it can.

    ``http_util`` and ``version`` default to the installed Ray's module and ``(major, minor)``
    (tests pass stand-ins). Checks, in order: the version is within
    :data:`CHECKED_RAY_VERSIONS`; the module imports; its ``socket`` global is the standard
    module (or already this patch's shim); ``start_asgi_http_server`` exists, takes
    :data:`SERVER_PARAMETERS` and reads the ``socket`` global.
    """
    version = _ray_version() if version is None else version
    first, last = CHECKED_RAY_VERSIONS
    if version is None or not first <= version < last:
        shown = "unknown" if version is None else ".".join(map(str, version))
        return f"Ray {shown} is outside the versions checked ({'.'.join(map(str, first))} to before {'.'.join(map(str, last))})"
    if http_util is None:
        try:
            from ray.serve._private import http_util
        except ImportError as exc:
            return f"{PATCHED_MODULE} does not import ({exc})"
    current = getattr(http_util, "socket", None)
    if current is not socket and not getattr(current, _SHIM_MARK, False):
        return f"{PATCHED_MODULE}.socket is not the socket module"
    server = getattr(http_util, "start_asgi_http_server", None)
    if not callable(server):
        return f"{PATCHED_MODULE}.start_asgi_http_server is missing"
    try:
        parameters = inspect.signature(server).parameters
    except (TypeError, ValueError):
        return f"{PATCHED_MODULE}.start_asgi_http_server has no readable signature"
    missing = [name for name in SERVER_PARAMETERS if name not in parameters]
    if missing:
        return f"{PATCHED_MODULE}.start_asgi_http_server lacks the parameters {missing}"
    code = getattr(inspect.unwrap(server), "__code__", None)
    if code is None or "socket" not in code.co_names:
        return f"{PATCHED_MODULE}.start_asgi_http_server no longer makes its socket through the module's socket global"
    return None


def _reusable_socket_module() -> types.ModuleType:
    """A copy of the ``socket`` module whose ``socket()`` sets ``SO_REUSEADDR`` on what it makes."""

    def reusable_socket(*args: Any, **kwargs: Any) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock

    shim = types.ModuleType("socket")
    shim.__dict__.update(vars(socket))
    shim.socket = reusable_socket
    setattr(shim, _SHIM_MARK, True)
    return shim


def reuse_address_for_direct_ingress(http_util: Any = None, version: tuple[int, int] | None = None) -> bool:
    """Make Serve's direct-ingress HTTP server set ``SO_REUSEADDR`` on its listening socket (see
    the module docstring). Call it before Serve starts that server (the ingress's ``__init__``
    does). Idempotent; returns whether the patch is in place. Where
    :func:`direct_ingress_patch_problem` names a problem it logs a warning and patches nothing.
    ``http_util`` and ``version``: as :func:`direct_ingress_patch_problem`."""
    problem = direct_ingress_patch_problem(http_util, version)
    if problem is not None:
        logger.warning(
            "not patching Ray Serve's direct-ingress socket (SO_REUSEADDR): %s. An ingress restarted "
            "on the same port may fail with EADDRINUSE for about a minute; check router/ray_compat.py "
            "against this Ray.", problem,
        )
        return False
    if http_util is None:
        from ray.serve._private import http_util
    if not getattr(http_util.socket, _SHIM_MARK, False):
        http_util.socket = _reusable_socket_module()
    return True
