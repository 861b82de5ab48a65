"""A collector that takes every OTLP/HTTP export at once, for `scripts/bench streams --otlp`.

`python -m benchmarks._otlp_sink` listens on a free loopback port (printed as
`listening http://127.0.0.1:PORT`), reads each POST's body and answers 200 with an empty
ExportTraceServiceResponse; it prints `exports N bytes B` to stdout when it stops. It keeps
nothing: what the bench measures is the relay's cost of exporting, not a store's.
"""

from __future__ import annotations

import http.server
import signal
import sys


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the relay's exporter keeps its connection
    exports = 0
    received = 0

    def do_POST(self) -> None:
        Sink.received += len(self.rfile.read(int(self.headers.get("content-length") or 0)))
        Sink.exports += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"listening http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        print(f"exports {Sink.exports} bytes {Sink.received}", flush=True)


if __name__ == "__main__":
    main()
