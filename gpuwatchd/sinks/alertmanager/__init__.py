"""Alertmanager: the API v2 client, the durable outbox and the sink that turns findings into
alerts.
"""
