"""PURE (but for :func:`key_from_env`): the optional keyed signature of a checkpoint manifest.

The manifest's ``digest`` (SHA-256 of its body) detects damage, but anyone who can write to the bucket can
recompute it. With a secret key in the environment variable ``ELASTICTRAIN_CHECKPOINT_KEY`` (e.g. a
Kubernetes secret, see ``k8s/``), every committed manifest also carries ``signature``: HMAC-SHA256 of its
canonical JSON body (without ``digest`` and ``signature``) under that key. A reader with the key refuses a
manifest that is unsigned or whose signature does not match, so tampering is detected, not just
corruption. A reader without the key does not check signatures (it cannot).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "ELASTICTRAIN_CHECKPOINT_KEY"
_PREFIX = "hmac-sha256:"


def key_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The signing key from ``ELASTICTRAIN_CHECKPOINT_KEY`` (UTF-8 bytes), or None when unset or empty."""
    value = (os.environ if environ is None else environ).get(KEY_ENV, "")
    return value.encode() if value else None


def _canonical(body: dict[str, Any]) -> bytes:
    rest = {k: v for k, v in body.items() if k not in ("digest", "signature")}
    return json.dumps(rest, sort_keys=True, allow_nan=False).encode()


def sign(body: dict[str, Any], key: bytes) -> str:
    """``hmac-sha256:<hex>`` of ``body`` (its ``digest`` and ``signature`` fields left out) under ``key``."""
    return _PREFIX + hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def signature_problem(body: dict[str, Any], key: bytes | None) -> str | None:
    """Why ``body`` fails the signature check under ``key``; None when it passes or there is no key."""
    if key is None:
        return None
    got = body.get("signature")
    if got is None:
        return (f"it is not signed, but {KEY_ENV} is set: a manifest written without the key (or with its "
                "signature stripped) is not trusted")
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), sign(body, key).encode()):
        return (f"its signature does not match under the key in {KEY_ENV}: the manifest was changed after it "
                "was signed, or was signed with another key")
    return None
