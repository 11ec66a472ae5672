"""Liveness: how hf_odc learns that a peer died, gave up or went silent, and names it instead of hanging.

Importing this package imports no torch (:mod:`hf_odc.liveness.launch` runs at hf_odc's first import).
"""
