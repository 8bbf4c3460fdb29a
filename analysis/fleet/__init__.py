"""Many stores as Parquet (`export`) and the fleet-level analyses over it in DuckDB."""
