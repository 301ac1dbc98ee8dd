"""Where this replica runs: its node's address and its Serve replica id (Ray-aware, safe outside Ray)."""

from __future__ import annotations

import os


def node_ip() -> str:
    """This node's IP address as Ray knows it (other nodes reach it there), or 127.0.0.1 outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def serve_app_name() -> str | None:
    """The Serve application this replica belongs to, or None outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:
        return None


def replica_id() -> str:
    """This replica's Serve id (``app#deployment#suffix``), or the pid outside Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:
        return f"pid-{os.getpid()}"
