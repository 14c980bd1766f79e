"""The served engine and load over HTTP (see docs/load.md)."""
