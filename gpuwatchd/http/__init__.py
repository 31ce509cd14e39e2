"""HTTP: the WSGI server, web-config (TLS, basic auth) and the routes (/metrics, /status, /events,
/alerts, /healthz).
"""
