"""Which addresses stay on this machine: the one rule behind every bind warning (the job's
control port and rendezvous store in runtime/supervisor.py, the dashboard in app/launch.py)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for `localhost` and every loopback address: 127.0.0.0/8, ::1, and IPv4 loopback
    written as IPv6 (::ffff:127.0.0.1, how a dual-stack socket reports it). A host name other
    than localhost, or 0.0.0.0 / :: (every interface), is not."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)
