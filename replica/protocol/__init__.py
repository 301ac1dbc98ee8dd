"""The engine's protocol: the torch- and Ray-free types the ingress shares with the engine (sampling
parameters, outputs, errors, prefix hashes, structured-output constraints, the delta channel's wire format)."""
