"""Autoscaling of the replica deployment: the settings (``settings.py``) and the Carpool policy
Serve's controller runs (``policy.py``)."""

from cluster.autoscaling.settings import AutoscalingSettings, parse_autoscale

__all__ = ["AutoscalingSettings", "parse_autoscale"]
