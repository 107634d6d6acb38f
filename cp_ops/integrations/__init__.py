"""Integrations of cp_ops with model libraries (diffusers)."""
