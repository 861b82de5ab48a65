"""Pin test of ttft_relay/patches/chunk_reader.py: h11's reader keeps where it is in a chunked body
where the module reads it, and no other module of the relay reaches into h11's private code."""

from __future__ import annotations

import ast
import importlib.metadata

from h11._receivebuffer import ReceiveBuffer

from ttft_relay.patches import chunk_reader
from ttft_relay.testing.harness import REPO
from tests.patches.pins import assert_unchanged, source


def test_the_h11_code_under_it_is_unchanged():
    assert importlib.metadata.version("h11") == "0.16.0"
    assert_unchanged(chunk_reader.PINS, chunk_reader)
    src = source(chunk_reader.ChunkedReader.__call__)
    assert all(name in src for name in ("self._bytes_in_chunk", "self._bytes_to_discard", "self._reading_trailer"))


def _read(reader: object, data: bytes) -> None:
    buf = ReceiveBuffer()
    buf += data
    while reader(buf) is not None:  # type: ignore[operator]
        pass


def test_it_says_where_the_reader_is_and_sets_where_it_goes_on():
    reader = chunk_reader.ChunkedReader()
    assert chunk_reader.position(reader) == (0, b"", False)  # before a chunk header
    _read(reader, b"a\r\n0123")
    assert chunk_reader.position(reader) == (6, b"", False)  # in the chunk's data
    _read(reader, b"456789")
    assert chunk_reader.position(reader) == (0, b"\r\n", False)  # its CRLF to skip
    chunk_reader.go_on_from(reader, 3, b"")  # a decoder read on and stopped in a chunk's data
    assert chunk_reader.position(reader) == (3, b"", False)
    _read(reader, b"abc\r\n0\r\n")
    assert chunk_reader.position(reader).trailer
    assert chunk_reader.position(object()) is None  # any other body reader


def test_no_other_module_of_the_relay_imports_a_private_module_of_h11s():
    found = []
    for path in sorted((REPO / "ttft_relay").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(REPO)}: {name}" for name in names if name.startswith("h11._")]
    assert found == []
