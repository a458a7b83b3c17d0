"""Prefect flows, the pipeline.toml schema and the `memplan` CLI."""
