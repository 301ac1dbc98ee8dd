"""What the ingress reports about itself: its own metrics (``metrics.py``) and the autoscaling
policy's record of its decisions, which ``/metrics`` reads (``autoscaler_record.py``)."""
