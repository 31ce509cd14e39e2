"""Job-level hang detection: detector, signature catalog, cross-rank summary."""
