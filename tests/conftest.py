"""Shared by every test directory: pytest puts this directory on ``sys.path`` for the
conftest here, so tests import their helpers from ``support`` (the fake engine, the
loop thread)."""
