"""Node RPC authentication: the cluster secret proven inside, and bound to, the TLS handshake.

Both ends of every node-RPC connection run TLS 1.3 (the stdlib ``ssl`` module, OpenSSL) with
*mutual* certificate authentication, and both present the same certificate: an Ed25519 key
pair derived from the cluster secret (``PBKDF2-HMAC-SHA256(secret, salt="narad-cluster-tls-key-v1",
KEY_ROUNDS)`` as the 32-byte Ed25519 seed) in a self-signed certificate whose every field is fixed, so every
node builds the identical DER (Ed25519 signatures are deterministic). Each end trusts exactly
that certificate (``CERT_REQUIRED``, it is the only trust anchor) and, after the handshake,
checks that the peer's certificate is byte-for-byte it (``pinned``).

Why this proves the secret and binds it to the session: in TLS 1.3 each side's
CertificateVerify is a signature, with the certificate's private key, over the hash of that
session's handshake transcript (both randoms and both ephemeral ECDHE key shares). Only a
holder of the secret can derive the private key, so only a holder can produce a valid
CertificateVerify, and a signature recorded on one session is worthless on any other (its
transcript differs): a proof cannot be relayed or replayed. The server's handshake completes
only after the client's CertificateVerify and Finished checked out, and the server accepts no
application data before that, so no handler ever runs for a peer that did not prove the
secret; the client trusts a reply only from a session whose server proved it. The ECDHE keys
are ephemeral, so the shared long-term key costs no forward secrecy. No session tickets are
issued (``num_tickets = 0``) and no session is resumed: every connection runs a full
handshake with both certificates.

Why not the obvious alternatives: the stdlib ``ssl`` module of Python 3.11 has no RFC 5705 /
8446 exporter (``SSL_export_keying_material`` is not exposed), and the ``tls-unique`` channel
binding is not defined for TLS 1.3 (RFC 8446 appendix C.5, RFC 9266). Without one of them an
HMAC challenge-response run *inside* a TLS session whose certificates nobody checks is not
bound to that session: an active man in the middle terminates one TLS session towards each
node and simply relays the challenges and answers between the two, ending up authenticated on
both with the plaintext in hand. Making the secret the TLS identity lets TLS itself do the
binding, with nothing hand-rolled: PBKDF2 from hashlib, Ed25519 from ``cryptography``, the handshake and
record protection from OpenSSL.

What an unauthenticated peer learns: in TLS 1.3 the server sends its certificate before it has
checked the client's, so anyone who reaches the port sees the public key, and can test guesses
of the secret against it offline (the QUIC proofs showed nothing derived from the secret to a
peer that had not proved it). A multi-node cluster requires a secret of at least 32 bytes; a
random one (``openssl rand -hex 32``) is out of reach, and the slow derivation (``KEY_ROUNDS``
PBKDF2 rounds, ~50-100 ms once per process) makes each guess at a weak one cost that much.

What an unauthenticated peer can cost: nothing of ours runs or buffers until the handshake
completed. During the handshake OpenSSL reads TLS records of at most 16 KiB and caps a
certificate chain (100 KiB); the event loop's TLS layer keeps at most one socket read (256
KiB, uvloop's fixed buffer); the server gives a handshake ``HANDSHAKE_TIMEOUT`` seconds and
keeps at most ``MAX_HANDSHAKING`` connections handshaking at once (the oldest is dropped to
make room), see narad.cluster.rpc_server.

The secret's key is derived once per process and secret (cached), off the event loop
(``context_off_loop``; NodeRpcServer.start and NodeRpcClient's first dial use it). Imports the stdlib and
``cryptography`` only (HMAC/PBKDF2 from hashlib, Ed25519 and X.509 from cryptography).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import ssl
import tempfile
from functools import lru_cache
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.x509.oid import NameOID

ALPN = "narad-cluster-tls-v1"
KEY_INFO = b"narad-cluster-tls-key-v1"  # the PBKDF2 salt (fixed: every node must derive the same key)
KEY_ROUNDS = 100_000
HANDSHAKE_TIMEOUT = 5.0  # seconds a server gives a peer to complete the TLS handshake
MAX_HANDSHAKING = 64  # connections a server lets handshake at once


@lru_cache(maxsize=4)
def identity(secret: bytes) -> tuple[bytes, bytes]:
    """(certificate DER, PEM of private key + certificate) for ``secret``: the same on every
    node holding it."""
    if not secret:
        raise ValueError("the cluster secret must not be empty")
    seed = hashlib.pbkdf2_hmac("sha256", secret, KEY_INFO, KEY_ROUNDS, 32)
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "narad-cluster")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))  # RFC 5280: no expiry
        .sign(key, None)  # Ed25519: deterministic, so every node makes the same DER
    )
    pem = (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
           + cert.public_bytes(serialization.Encoding.PEM))
    return cert.public_bytes(serialization.Encoding.DER), pem


def _load_chain(ctx: ssl.SSLContext, pem: bytes) -> None:
    """``load_cert_chain`` takes only a path: hand it an anonymous in-memory file (memfd) so
    the key never touches a disk; a private temporary file where memfd is missing."""
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        fd = memfd("narad-cluster-tls", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
            return
        except OSError:
            pass
        finally:
            os.close(fd)
    with tempfile.TemporaryDirectory(prefix="narad-tls-") as d:
        path = Path(d) / "chain.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, pem)
        finally:
            os.close(fd)
        ctx.load_cert_chain(str(path))


def context(secret: bytes, *, server: bool) -> ssl.SSLContext:
    """A TLS 1.3-only context presenting and trusting only the secret's certificate."""
    der, pem = identity(bytes(secret))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False  # the peer is named by its certificate, which is the secret's
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=der)
    _load_chain(ctx, pem)
    ctx.set_alpn_protocols([ALPN])
    if server:
        ctx.num_tickets = 0  # no resumption: every connection proves the secret in full
    ctx.options |= ssl.OP_NO_TICKET
    return ctx


async def context_off_loop(secret: bytes, *, server: bool) -> ssl.SSLContext:
    """``context``, with the slow derivation (``KEY_ROUNDS`` of PBKDF2, 50-100 ms, more on a
    loaded box) run on a thread when this process has not derived the secret's key yet:
    hashlib releases the GIL for it, so the event loop keeps serving meanwhile."""
    await asyncio.to_thread(identity, bytes(secret))
    return context(secret, server=server)


def warm(secret: bytes) -> None:
    """Derive the secret's key now (a process about to fork workers calls this so that they
    inherit it instead of each deriving it)."""
    identity(bytes(secret))


def pinned(ssl_object: ssl.SSLObject | None, secret: bytes) -> str | None:
    """None when the completed handshake of ``ssl_object`` is ours (TLS 1.3, our ALPN, the
    peer's certificate exactly the secret's), else what is wrong."""
    if ssl_object is None:
        return "not a TLS connection"
    if ssl_object.version() != "TLSv1.3":
        return f"TLS version {ssl_object.version()}"
    if ssl_object.selected_alpn_protocol() != ALPN:
        return f"ALPN {ssl_object.selected_alpn_protocol()!r}, not {ALPN}"
    if ssl_object.getpeercert(binary_form=True) != identity(bytes(secret))[0]:
        return "the peer's certificate is not the cluster's"
    return None
