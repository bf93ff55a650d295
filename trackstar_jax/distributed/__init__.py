"""Distributed: the one place that builds meshes and shardings (`sharding`), and multi-host
coordination (`multihost`: jax.distributed, fail-fast barriers, writer partitions), and the
process's shared JAX settings (`runtime`: the persistent compilation cache)."""
