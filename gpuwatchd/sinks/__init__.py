"""Sinks: what consumes the state (exposition, event store, Alertmanager, remediation)."""
