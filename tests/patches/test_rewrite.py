"""ttft_relay/patches/rewrite.py: the command rewriting the layer wraps share."""

from __future__ import annotations

from ttft_relay.patches.rewrite import replacing


def test_replacing_passes_hook_replies_to_the_original_generator():
    got = []

    def original():
        got.append((yield "hook"))
        yield "error to client"
        got.append((yield "after"))

    out = replacing(original(), lambda c: ["a", "b"] if c == "error to client" else None)
    assert next(out) == "hook"
    assert out.send("reply") == "a"
    assert next(out) == "b"
    assert next(out) == "after"
    try:
        out.send("reply 2")
    except StopIteration:
        pass
    assert got == ["reply", "reply 2"]
