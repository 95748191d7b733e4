"""The SSRF guard of webhooks: which URLs llmq may call, checked at submit and again at delivery.

A webhook URL is the caller's choice of where the service connects to, so without a guard any
API key could make the workers probe the private network (cloud metadata at 169.254.169.254,
Redis on 127.0.0.1). The host is resolved and every address it resolves to must be public;
loopback, private, link-local, shared, reserved and multicast addresses are refused unless the
host is listed in LLMQ_WEBHOOK_ALLOWED_HOSTS. Delivery resolves again, checks again and
connects to the address it checked (a host that re-resolves to 127.0.0.1 after passing the
check at submit, DNS rebinding, gets nowhere).
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL_CHARS = 2048


class WebhookURLError(ValueError):
    """A webhook URL llmq will not call; the message says why, in words safe to show the caller
    (`detail` adds what only the server's log may hold: the addresses, the resolver's error)."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


class WebhookUnresolvable(WebhookURLError):
    """The host does not resolve (now): at delivery, worth another try later."""


@dataclass(frozen=True)
class Target:
    """A checked webhook URL: where to connect (addresses) and what to ask for."""

    scheme: str
    host: str
    port: int
    path: str                      # path and query
    addresses: tuple[str, ...]     # every address the host resolved to, all allowed

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


# IPv6 ranges that carry an IPv4 address in their last 32 bits, which is what a packet to them
# reaches through a translator: NAT64's well-known prefix (64:ff9b::/96), IPv4-compatible
# (::/96) and IPv4-translated (::ffff:0:0:0/96) addresses.
_EMBEDS_IPV4 = tuple(ipaddress.ip_network(n)
                     for n in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96"))
# Refused whatever they carry: local-use NAT64 (64:ff9b:1::/48, a site's own translator),
# Teredo (2001::/32) and deprecated site-local (fec0::/10) addresses.
_REFUSED_V6 = tuple(ipaddress.ip_network(n)
                    for n in ("64:ff9b:1::/48", "2001::/32", "fec0::/10"))


def _blocked(addr: str) -> bool:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in net for net in _REFUSED_V6):
            return True
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip.sixtofour is not None:                        # 2002:a.b.c.d::/48
            ip = ip.sixtofour
        elif any(ip in net for net in _EMBEDS_IPV4) and int(ip) & 0xFFFFFFFF > 1:
            ip = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)   # (::, ::1 stay themselves)
    # is_global is False for loopback, private, link-local, shared (100.64/10), reserved
    # and unspecified addresses; multicast is refused as well.
    return not ip.is_global or ip.is_multicast


def check_url(url: str, allowed_hosts: tuple[str, ...] = (), resolve=socket.getaddrinfo
              ) -> Target:
    """Parses, resolves and checks a webhook URL; raises WebhookURLError when not allowed."""
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS:
        raise WebhookURLError(f"webhook must be a URL of at most {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookURLError(f"webhook is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookURLError("webhook must be an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise WebhookURLError("webhook URL must not carry credentials")
    host = name = parts.hostname.lower()
    if not host.isascii():   # the name as DNS and the Host header know it (IDNA, punycode)
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise WebhookURLError("webhook host is not a valid host name") from None
    port = port or (443 if parts.scheme == "https" else 80)
    # Unresolvable and non-public read the same to the caller: the difference, or the address,
    # would tell any key which internal names exist and where they point.
    refused = (f"webhook host {host!r} does not resolve to public addresses only; list it in "
               "LLMQ_WEBHOOK_ALLOWED_HOSTS to allow a private one")
    try:
        infos = resolve(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise WebhookUnresolvable(refused, f"does not resolve: {exc}") from None
    addresses = tuple(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise WebhookUnresolvable(refused, "resolves to no address")
    if host not in allowed_hosts and name not in allowed_hosts:
        bad = [a for a in addresses if _blocked(a)]
        if bad:
            raise WebhookURLError(refused, f"resolves to non-public {', '.join(bad)}")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port, path, addresses)
