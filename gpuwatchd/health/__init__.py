"""Health: the Xid catalog, rules and the engine that turns samples into verdicts."""
