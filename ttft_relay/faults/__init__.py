"""Failures: bounded waits, upstream failures answered in each API's own format, a clean stop."""
