"""The relay's patches into mitmproxy, each pinned by tests/test_seams.py."""
