"""A throwaway certificate authority and a localhost server certificate for TLS tests.

The certificates satisfy Python 3.13's strict X.509 checks (`VERIFY_X509_STRICT`
is on in `ssl.create_default_context()`): critical basic constraints and key usage
on the CA, subject/authority key identifiers, and SANs for `localhost` and
`127.0.0.1` on the leaf. EC P-256 keys keep creation to a few milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TestCerts:
    """PEM files of a test CA and a server certificate (with its key) signed by it.

    A client trusts the server by trusting `ca_pem` (e.g. `SSL_CERT_FILE`,
    `ssl.create_default_context(cafile=...)`, mitmproxy's
    `ssl_verify_upstream_trusted_ca`).
    """

    __test__ = False  # not a pytest test class, despite the name

    ca_pem: Path
    cert_pem: Path
    key_pem: Path

    @property
    def cert_and_key_pem(self) -> Path:
        """The certificate followed by its key in one file, as mitmproxy's `certs` option
        reads it (`cat fullchain.pem privkey.pem`)."""
        return self.cert_pem.with_name("cert-and-key.pem")

    @classmethod
    def create(cls, dirpath: str | Path, ips: tuple[str, ...] = ("127.0.0.1",)) -> TestCerts:
        """Write ca.pem, cert.pem and key.pem into `dirpath` (created if missing); the server
        certificate names localhost and `ips` (a far link's address, say)."""
        directory = Path(dirpath)
        directory.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _ca_certificate(ca_key)
        server_key = ec.generate_private_key(ec.SECP256R1())
        server_cert = _server_certificate(server_key, ca_cert, ca_key, ips)

        certs = cls(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
        certs.ca_pem.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        certs.cert_pem.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
        certs.key_pem.write_bytes(
            server_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        certs.cert_and_key_pem.write_bytes(certs.cert_pem.read_bytes() + certs.key_pem.read_bytes())
        return certs

    def server_context(self, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
        """A server-side context presenting the localhost certificate, offering `alpn` (default: HTTP/1.1 only)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_pem, self.key_pem)
        context.set_alpn_protocols(list(alpn))
        return context

    def client_context(self) -> ssl.SSLContext:
        """A client-side context that trusts only the test CA, HTTP/1.1 only."""
        context = ssl.create_default_context(cafile=str(self.ca_pem))
        context.set_alpn_protocols(["http/1.1"])
        return context


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    # Backdated a day so clock skew between processes cannot make a fresh cert "not yet valid".
    now = datetime.datetime.now(datetime.UTC)
    return builder.not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + VALIDITY)


def _ca_certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    public = key.public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name("ttft-relay test CA"))
        .issuer_name(_name("ttft-relay test CA"))
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )
    return _validity(builder).sign(key, hashes.SHA256())


def _server_certificate(
    key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
    ips: tuple[str, ...],
) -> x509.Certificate:
    public = key.public_key()
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    return _validity(builder).sign(ca_key, hashes.SHA256())
