-- Runs once, when the PostgreSQL volume is first initialized: the `dagster` database is created
-- by the image (POSTGRES_DB); MLflow's tracking and registry store gets its own database.
CREATE DATABASE mlflow;
