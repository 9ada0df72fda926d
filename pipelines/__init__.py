"""The Dagster code location: definitions, the deploy job, sensors and resources."""
