"""Analyses over one run's store tables: each takes a ``RunTables`` and returns data."""
