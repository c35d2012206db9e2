"""``elastictrain ckpt sign``: sign committed checkpoints under the current key (a rotated key, or a
checkpoint written before signing was turned on).

With ``ELASTICTRAIN_CHECKPOINT_KEY`` set, a reader refuses manifests that are unsigned or signed under
another key. Two users need a way out that is not "start over": one who rotates the key (every checkpoint
was signed under the old one) and one who turns signing on for a run whose checkpoints predate it. Signing
is an attestation, so what may be signed is a pure decision (:func:`decide`):

- signed under the current key already: left alone;
- signed under the previous key (``previous_key``, the rotation): re-signed; a manifest that is not signed
  under it (unsigned, tampered, another key) is refused: a rotation vouches only for what the old key did;
- unsigned, and no previous key given: signed. The digest proves nothing against someone who could write to
  the bucket, so the caller vouches for it; the files are checked against the manifest first anyway.
- signed under an unknown key, and no previous key given: refused (pass the key it was signed with).

Before signing, every listed file is re-read and hashed against the manifest, and a file the manifest does
not list fails it (:meth:`~elastictrain.checkpoint.store.CheckpointStore.verify`). The new manifest is the
stored JSON body unchanged but for ``signature`` and ``digest``, written atomically over the old one: the
one exception to "a manifest is never overwritten", which changes no byte a reader loads.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any, Literal

from elastictrain.checkpoint import storage
from elastictrain.checkpoint.errors import CheckpointError
from elastictrain.checkpoint.manifest import MANIFEST_NAME, manifest_digest, manifest_from_json
from elastictrain.checkpoint.signing import sign
from elastictrain.checkpoint.store import CheckpointStore

Action = Literal["sign", "keep", "refuse"]


@dataclass(frozen=True)
class SignDecision:
    """What :func:`decide` chose for one manifest, and why (printed by ``ckpt sign``)."""

    action: Action
    reason: str


def _signed_by(body: dict[str, Any], key: bytes) -> bool:
    got = body.get("signature")
    return isinstance(got, str) and hmac.compare_digest(got.encode(), sign(body, key).encode())


def decide(body: dict[str, Any], key: bytes, previous_key: bytes | None) -> SignDecision:
    """PURE: sign, keep or refuse the manifest ``body`` (its stored JSON, digest already checked)."""
    if _signed_by(body, key):
        return SignDecision("keep", "already signed under the current key")
    if previous_key is not None:
        if _signed_by(body, previous_key):
            return SignDecision("sign", "signed under the previous key: re-signed under the current one")
        what = "unsigned" if "signature" not in body else "signed, but not under the previous key"
        return SignDecision("refuse", f"{what}: a key rotation re-signs only what the previous key signed (sign "
                                      "an unsigned checkpoint you trust without --previous-key-env)")
    if "signature" in body:
        return SignDecision("refuse", "signed under another key: pass the key it was signed with in an "
                                      "environment variable named by --previous-key-env to rotate it")
    return SignDecision("sign", "unsigned: signed, its files verified (signing vouches for its contents)")


def resigned_json(body: dict[str, Any], key: bytes) -> str:
    """The stored JSON of ``body`` signed under ``key``: every other field as it was, a new digest."""
    out = {k: v for k, v in body.items() if k not in ("signature", "digest")}
    out["signature"] = sign(out, key)
    out["digest"] = manifest_digest(out)
    return json.dumps(out, indent=1, sort_keys=True, allow_nan=False)


def sign_step(store: CheckpointStore, step: int, key: bytes, previous_key: bytes | None) -> SignDecision:
    """Decide for the committed ``step`` of ``store`` and, when the decision is to sign, verify its files
    and write the signed manifest. Raises CheckpointError when the manifest cannot be read or parsed."""
    step_uri = store.step_uri(step)
    where = storage.join(step_uri, MANIFEST_NAME)
    fs, path = storage.open_fs(step_uri, store.storage_options)
    manifest_path = storage.join(path, MANIFEST_NAME)
    try:
        data = storage.read_bytes(fs, manifest_path, where)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: no manifest (not a committed checkpoint)") from None
    manifest = manifest_from_json(data, where, location=step_uri, key=None)  # digest and shape checked
    if manifest.step != step:
        raise CheckpointError(f"{where}: says step {manifest.step} but lies in step {step}'s directory")
    decision = decide(json.loads(data), key, previous_key)
    if decision.action != "sign":
        return decision
    problems = store.verify(manifest, checksums=True)
    if problems:
        return SignDecision("refuse", "its files do not match the manifest: " + "; ".join(problems))
    storage.write_atomic(fs, manifest_path, resigned_json(json.loads(data), key).encode(), create_only=False,
                         uri=where)
    CheckpointStore(store.root_uri, store.storage_options, key=key).read_manifest(step)  # reads back as trusted
    return decision
