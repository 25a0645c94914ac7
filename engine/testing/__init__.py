"""Builders of small random-weight models and the reference semantics, for tests."""
