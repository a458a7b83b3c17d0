"""The profile store: Parquet files, their schema, DuckDB queries, reachability."""
