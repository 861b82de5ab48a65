"""Upstream groups: a reverse listener with several upstreams for its API, one chosen per request.

`members.py` reads the option (`relay_upstream_groups`), `choice.py` chooses a member by the
first token each is expected to give (pure), `groups.py` is the addon that aims each request
at its member and fails over to the next before any byte of an answer reached the client.
"""
