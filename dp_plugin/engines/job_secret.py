"""Signing what rank 0 publishes in Horovod's unauthenticated rendezvous server.

Under horovodrun, rank 0 PUTs its store address as an HTTP key that anyone
who can reach the server may write. With ``DP_PLUGIN_JOB_SECRET`` set (the
same value on every rank; horovodrun forwards the environment), rank 0
publishes ``address#tag``, ``tag`` an HMAC-SHA256 under the secret of the
address, the rendezvous server's address and the init generation (so a
value from another job, or another init of this one, does not verify), and
the other ranks accept only a value whose tag verifies. Without a secret the
address travels bare, as before.
"""

from __future__ import annotations

import hashlib
import hmac

SEPARATOR = "#"


def _tag(secret: str, context: str, address: str) -> str:
    message = f"{context}|{address}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str | None, context: str, address: str) -> str:
    """What rank 0 publishes: ``address`` alone, or ``address#tag`` with a secret."""
    if secret is None:
        return address
    return f"{address}{SEPARATOR}{_tag(secret, context, address)}"


def verify(secret: str | None, context: str, published: str) -> tuple[str | None, str]:
    """(the address, or None if ``published`` must not be trusted; why not)."""
    address, sep, tag = published.rpartition(SEPARATOR)
    if secret is None:
        if sep:
            return None, ("it is signed (rank 0 has DP_PLUGIN_JOB_SECRET) but this rank has no "
                          "DP_PLUGIN_JOB_SECRET: set the same secret on every rank")
        return published, ""
    if not sep:
        return None, ("it is not signed: rank 0 has no DP_PLUGIN_JOB_SECRET, or someone else "
                      "wrote the key")
    if not hmac.compare_digest(tag, _tag(secret, context, address)):
        return None, ("its signature does not verify: the ranks have different "
                      "DP_PLUGIN_JOB_SECRET values, or someone else wrote the key")
    return address, ""
