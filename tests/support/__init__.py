"""Helpers shared by test modules (no tests here): test modules import these,
never each other."""
