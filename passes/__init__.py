"""Inductor FX passes of cp_ops (the K/V-communication overlap pass arrives with its own issue)."""
