"""trackstar_jax: TrackStar training-data attribution in JAX (Chang et al., ICLR 2025)."""

__version__ = "0.1.0"
