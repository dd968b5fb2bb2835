"""The project's environment variables: ``KVMAP_*``.

They were named ``SGL_KVMAP_*`` once, but SGLang treats every ``SGL_*`` variable as a
deprecated spelling of ``SGLANG_*`` (it warns at import and copies it), so the old names are
still read, with a warning, when the new one is not set.
"""

from __future__ import annotations

import os
import warnings

PREFIX = "KVMAP_"
LEGACY_PREFIX = "SGL_KVMAP_"


def setting(name: str, default: str | None = None) -> str | None:
    """The value of ``KVMAP_<name>``, else of the legacy ``SGL_KVMAP_<name>`` (warned), else
    ``default``."""
    value = os.environ.get(PREFIX + name)
    if value is not None:
        return value
    legacy = os.environ.get(LEGACY_PREFIX + name)
    if legacy is not None:
        warnings.warn(
            f"{LEGACY_PREFIX + name} is read as {PREFIX + name}: rename it (SGLang reads every "
            f"SGL_* variable as a deprecated SGLANG_* one)",
            DeprecationWarning,
            stacklevel=2,
        )
        return legacy
    return default
