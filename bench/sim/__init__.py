"""Prefix-cache simulator for ``python -m bench simulate``: workloads, cache policies, bounds and
routers. No model, no torch: requests are sequences of units (tokens, or trace blocks)."""
