"""Parallelism: data-parallel ranks (``torchrun``) and FSDP sharding."""
