"""The HMAC secret that names owners, shared by every API replica through Redis."""
from __future__ import annotations

import secrets

from .base import OWNER_SECRET_KEY, StorePart


class OwnerSecret(StorePart):
    """Makes the owner-naming secret once and hands every replica the same one."""

    def owner_secret(self, known: str | None = None) -> str:
        """The HMAC secret that names owners, made once and shared by every API replica (for
        deployments that set no LLMQ_OWNER_SECRET); `known`, the one last read, is put back
        if Redis lost it."""
        pipe = self.r.pipeline(transaction=True)
        pipe.set(OWNER_SECRET_KEY, known or secrets.token_hex(32), nx=True)
        pipe.get(OWNER_SECRET_KEY)
        return pipe.execute()[1]
