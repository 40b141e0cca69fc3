"""Adapters for code written against other frameworks."""
