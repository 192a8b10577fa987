"""The half both worker roles share: an engine driven by an AsyncEngine, stats, KV events."""
