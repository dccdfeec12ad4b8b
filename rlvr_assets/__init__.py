"""Dagster assets of rlvr-ops; ``rlvr_assets.definitions`` holds the one Definitions object."""
