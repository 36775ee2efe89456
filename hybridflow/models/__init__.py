"""Builders of the small models the quickstart and the tests make from scratch (no downloads)."""
