"""Replica choice: which replica serves a request (free seats, prefix affinity)."""
