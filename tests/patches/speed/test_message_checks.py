"""Pin test of ttft_relay/patches/speed/message_checks.py: every value passes or fails as mitmproxy's check has it."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

import pytest
from mitmproxy import http
from mitmproxy.utils import typecheck

from ttft_relay.patches.speed import message_checks
from tests.patches.pins import assert_unchanged


def test_the_mitmproxy_code_under_it_is_unchanged():
    assert_unchanged(message_checks.PINS, message_checks)


class Odd:
    pass


VALUES = [None, True, 0, 7, 1.5, "", "text", b"", b"bytes", http.Headers(), Odd(), [b"x"], (1, 2), {"a": 1}]
ANNOTATIONS = [bytes, str, int, float, bool, http.Headers, bytes | None, float | None, http.Headers | None,
               typing.Optional[int],  # noqa: UP045  # typing.Union, not types.UnionType
               int | str, typing.Any, Sequence[str], tuple[int, int], typing.IO, typing.TextIO, list[bytes]]


def _outcome(check, typeinfo, value) -> str | None:
    try:
        check(value, typeinfo)
    except TypeError as e:
        return str(e)
    return None


def _planned(value, typeinfo) -> None:
    classes = message_checks.accepted(typeinfo)
    if classes is None or not isinstance(value, classes):
        typecheck.check_option_type("field", value, typeinfo)


@pytest.mark.parametrize("typeinfo", ANNOTATIONS, ids=str)
def test_a_value_passes_or_fails_as_mitmproxy_has_it(typeinfo):
    for value in VALUES:
        assert _outcome(_planned, typeinfo, value) == _outcome(
            lambda v, t: typecheck.check_option_type("field", v, t), typeinfo, value), value


def test_every_field_of_requests_and_responses_is_checked_from_plain_classes():
    # What the wrap buys: no field falls back to mitmproxy's check for a value of its type.
    for cls in (http.RequestData, http.ResponseData):
        for field in dataclasses.fields(cls):
            assert message_checks.accepted(field.type) is not None, (cls, field.name, field.type)


@pytest.fixture
def installed():
    message_checks.install_message_checks(True)
    yield
    message_checks.uninstall()


def test_messages_built_and_refused_as_before(installed):
    request = http.Request.make("POST", "http://example.com/v1/chat", b"{}", {"content-type": "application/json"})
    response = http.Response.make(200, b"data: x\n\n", {"content-type": "text/event-stream"})
    assert (request.host, request.port, request.content, response.status_code) == ("example.com", 80, b"{}", 200)
    fields = dict(host="h", port=1, method=b"GET", scheme=b"http", authority=b"", path=b"/", http_version=b"HTTP/1.1",
                  headers=http.Headers(), content=None, trailers=None, timestamp_start=1, timestamp_end=None)
    for name, wrong in (("port", "80"), ("method", "GET"), ("headers", {}), ("timestamp_start", None)):
        with pytest.raises(TypeError) as patched:
            http.RequestData(**{**fields, name: wrong})
        message_checks.uninstall()
        with pytest.raises(TypeError) as original:
            http.RequestData(**{**fields, name: wrong})
        message_checks.install_message_checks(True)
        assert str(patched.value) == str(original.value)
