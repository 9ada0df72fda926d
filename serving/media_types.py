"""The request bodies MLflow's scoring server reads, by media type: the router and the pyfunc
replica accept the same ones (JSON everywhere; CSV and Parquet only for a classic model)."""

JSON_TYPE = "application/json"
CSV_TYPE = "text/csv"
PARQUET_TYPE = "application/vnd.apache.parquet"
TABULAR_TYPES = (CSV_TYPE, PARQUET_TYPE)
