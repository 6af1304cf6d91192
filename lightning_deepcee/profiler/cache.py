"""Fingerprints that tie a saved profile to a model and a device set, and the profile cache.

A saved profile is reused only when both fingerprints match; otherwise a warning says why and
the caller measures again. A stale profile is never reused silently. Pure: no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_deepcee.profiler import _checks as check
from lightning_deepcee.profiler.cluster import ClusterProfile

__all__ = ["ProfileCacheWarning", "fingerprint", "fingerprint_cluster", "load_cached_profile"]


class ProfileCacheWarning(UserWarning):
    """A cached profile exists but was not reused; the cluster will be measured again."""


def fingerprint(obj: Any) -> str:
    """First 16 hex digits of the sha256 of ``obj`` as canonical JSON (sorted keys, no spaces).

    ``obj`` must be JSON-serialisable (dicts, lists, tuples, strings, numbers, bools, None); a
    ``TypeError`` says otherwise. Used for both ``model_fingerprint`` (a description of the model
    structure) and ``cluster_fingerprint`` (see :func:`fingerprint_cluster`).
    """
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def fingerprint_cluster(hosts_by_rank: Sequence[str]) -> str:
    """Fingerprint of the device set: the host of each rank, in rank order."""
    hosts = check.sequence("hosts_by_rank", hosts_by_rank, check.text)
    return fingerprint([{"rank": rank, "host": host} for rank, host in enumerate(hosts)])


def load_cached_profile(
    path: str | os.PathLike[str], *, model_fingerprint: str, cluster_fingerprint: str
) -> ClusterProfile | None:
    """Return the profile saved at ``path`` if it was measured for this model and device set.

    - No file: ``None``, silently (first run).
    - Unreadable or malformed file, or either fingerprint differs: a :class:`ProfileCacheWarning`
      saying why, then ``None`` so the caller re-measures. A stale profile is never reused.

    ``.json`` files are read as JSON, anything else as YAML.
    """
    file = Path(path)
    if not file.exists():
        return None
    try:
        if file.suffix.lower() == ".json":
            profile = ClusterProfile.from_json(file)
        else:
            profile = ClusterProfile.from_yaml(file)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        warnings.warn(
            f"Cached cluster profile {str(file)!r} could not be read ({exc}); ignoring it and "
            "re-measuring the cluster. Delete or fix the file to silence this warning.",
            ProfileCacheWarning,
            stacklevel=2,
        )
        return None
    mismatches = []
    if profile.model_fingerprint != model_fingerprint:
        mismatches.append(
            f"model_fingerprint is {profile.model_fingerprint!r} but the current model's is "
            f"{model_fingerprint!r} (the model structure changed)"
        )
    if profile.cluster_fingerprint != cluster_fingerprint:
        mismatches.append(
            f"cluster_fingerprint is {profile.cluster_fingerprint!r} but the current cluster's is "
            f"{cluster_fingerprint!r} (the hosts or ranks changed)"
        )
    if mismatches:
        warnings.warn(
            f"Cached cluster profile {str(file)!r} does not match this run: "
            f"{'; '.join(mismatches)}. Ignoring it and re-measuring the cluster.",
            ProfileCacheWarning,
            stacklevel=2,
        )
        return None
    return profile
