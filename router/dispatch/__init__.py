"""Running a prepared request on the replicas: the replicas' health and capacity as the ingress sees
them (``replica_view.py``), the fan-out of a request's choices with retry, cancellation and the
shutdown drain (``fanout.py``), one choice's stream (``choice_stream.py``) and the batched-delta
connections its tokens come back on (``delta_receiver.py``)."""
