"""Sinks: consumers of the state (Prometheus, Alertmanager, event store, status API)."""
