"""``router/ray_compat.py``: the one patch of Ray Serve's internals, checked against the installed Ray.

The first tests fail when an upgrade of Ray changes what the patch relies on (the version range
it was checked against, ``ray.serve._private.http_util.socket``, ``start_asgi_http_server``'s
signature and its use of that global, the replica calling that same function): re-check the
patch against the new Ray's source, then widen ``CHECKED_RAY_VERSIONS``. The others check the
patch itself and its logged fallback on stand-in modules.
"""

from __future__ import annotations

import inspect
import logging
import socket
import types

import pytest

from router import ray_compat
from router.ray_compat import (
    CHECKED_RAY_VERSIONS,
    SERVER_PARAMETERS,
    direct_ingress_patch_problem,
    reuse_address_for_direct_ingress,
)


# ---- the installed Ray still has what the patch relies on --------------------------------------
def test_the_installed_ray_is_a_version_the_patch_was_checked_against():
    import ray

    major, minor = (int(p) for p in ray.__version__.split(".")[:2])
    first, last = CHECKED_RAY_VERSIONS
    assert first <= (major, minor) < last, (
        f"Ray {ray.__version__}: check router/ray_compat.py against this Ray's Serve, then widen CHECKED_RAY_VERSIONS"
    )


def test_serve_s_http_helper_still_has_the_patched_global_and_signature():
    from ray.serve._private import http_util
    from ray.serve._private import replica as serve_replica

    assert http_util.socket is socket or getattr(http_util.socket, "__carpool_reuse_address__", False)
    parameters = inspect.signature(http_util.start_asgi_http_server).parameters
    assert set(SERVER_PARAMETERS) <= set(parameters)
    assert parameters["enable_so_reuseport"].kind is inspect.Parameter.KEYWORD_ONLY
    # The replica's direct ingress starts its server through this very function.
    assert serve_replica.start_asgi_http_server is http_util.start_asgi_http_server
    source = inspect.getsource(http_util.start_asgi_http_server)
    assert "socket.socket(" in source and "enable_so_reuseport=False" in inspect.getsource(serve_replica)
    assert direct_ingress_patch_problem() is None


def test_the_patch_applies_to_the_installed_ray_and_is_idempotent(monkeypatch):
    from ray.serve._private import http_util

    monkeypatch.setattr(http_util, "socket", socket)  # restored after the test
    assert reuse_address_for_direct_ingress() is True
    shim = http_util.socket
    assert shim is not socket
    assert reuse_address_for_direct_ingress() is True and http_util.socket is shim  # not wrapped twice
    with shim.socket(shim.AF_INET, shim.SOCK_STREAM) as sock:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) != 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as plain:  # the real module is untouched
        assert plain.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 0


# ---- the checks and the fallback, on stand-ins ------------------------------------------------
def _fake_http_util(**overrides) -> types.SimpleNamespace:
    def start_asgi_http_server(app, http_options, *, event_loop, enable_so_reuseport=False):
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    fields = {"socket": socket, "start_asgi_http_server": start_asgi_http_server, **overrides}
    return types.SimpleNamespace(**fields)


def test_a_matching_stand_in_is_patched():
    fake = _fake_http_util()
    assert direct_ingress_patch_problem(fake, (2, 60)) is None
    assert reuse_address_for_direct_ingress(fake, (2, 60)) is True
    assert fake.socket is not socket and fake.socket.AF_INET == socket.AF_INET


def _takes_no_reuseport(app, http_options, *, event_loop):
    return socket.socket()


def _makes_no_socket(app, http_options, *, event_loop, enable_so_reuseport=False):
    return None


@pytest.mark.parametrize(
    "fake, version, expected",
    [
        (_fake_http_util(), (2, 61), "Ray 2.61 is outside the versions checked"),
        (_fake_http_util(), (2, 59), "Ray 2.59 is outside the versions checked"),
        (_fake_http_util(), None, None),  # None: the installed version, which is checked
        (_fake_http_util(socket=types.ModuleType("socket")), (2, 60), "socket is not the socket module"),
        (types.SimpleNamespace(socket=socket), (2, 60), "start_asgi_http_server is missing"),
        (_fake_http_util(start_asgi_http_server=_takes_no_reuseport), (2, 60), "lacks the parameters ['enable_so_reuseport']"),
        (_fake_http_util(start_asgi_http_server=_makes_no_socket), (2, 60), "no longer makes its socket"),
    ],
    ids=["newer-ray", "older-ray", "installed-version", "socket-replaced", "no-server", "signature-changed", "no-socket-global"],
)
def test_each_change_in_serve_is_named_and_nothing_is_patched(fake, version, expected, caplog):
    original = fake.socket
    problem = direct_ingress_patch_problem(fake, version)
    if expected is None:
        assert problem is None
        return
    assert problem is not None and expected in problem
    with caplog.at_level(logging.WARNING, logger=ray_compat.__name__):
        assert reuse_address_for_direct_ingress(fake, version) is False
    assert fake.socket is original
    assert "not patching Ray Serve's direct-ingress socket" in caplog.text and expected in caplog.text
