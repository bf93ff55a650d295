"""Distributed: the one place that builds meshes and shardings (`sharding`), and multi-host
coordination (`multihost`: jax.distributed, fail-fast barriers, writer partitions)."""
