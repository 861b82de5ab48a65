"""Timing: marks, phases and verdicts (pure), the record and its sinks (JSONL, console, mitmweb comment)."""
