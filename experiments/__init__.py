"""Experiment configs: `get_config(arg)` per file (ml_collections, flax lm1b style)."""
