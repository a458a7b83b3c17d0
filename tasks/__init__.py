"""Pipeline stages: plain functions first, thin Prefect task wrappers second."""
