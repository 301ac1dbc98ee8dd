"""The Ray Serve replica: the deployment (:class:`LLMReplica`), its delta channel and logging. The
only package of the engine that imports Ray.

This package's own names are the engine's Serve entry, the one part of ``replica.serve`` that the
router and the cluster import: :class:`LLMReplica` (loaded on first use: it pulls in torch),
:func:`replica_id` and the logging set-up.
"""

from replica.serve.logs import log_through_serve, log_to_stderr
from replica.serve.replica_info import node_ip, replica_id, serve_app_name

__all__ = ["LLMReplica", "log_through_serve", "log_to_stderr", "node_ip", "replica_id", "serve_app_name"]


def __getattr__(name):  # lazy: the ingress imports this package and stays free of torch
    if name == "LLMReplica":
        from replica.serve.deployment import LLMReplica

        return LLMReplica
    raise AttributeError(name)
