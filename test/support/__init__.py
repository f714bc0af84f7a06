"""Shared builders for the tests (import as `support.<module>`; test/ is on sys.path via conftest)."""
