"""The transformers versions the Hugging Face adapter can use, checked first
when :mod:`lightning_roundpipe` is imported: before Lightning, so that an
unusable version is refused in a fraction of a second, not after the
seconds importing Lightning takes."""

from importlib.metadata import PackageNotFoundError, version

#: the oldest transformers the Hugging Face adapter works with: its mask
#: functions take ``allow_is_causal_skip`` from 5.15 on (``pyproject.toml``'s
#: ``hf`` extra says the same; a test holds them together)
MIN_TRANSFORMERS = "5.15.0"


def check_transformers(found: str | None) -> None:
    """Refuse an installed transformers older than :data:`MIN_TRANSFORMERS`
    (``found``: its version, None when it is not installed)."""
    from packaging.version import Version

    if found is not None and Version(found) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"lightning_roundpipe needs transformers>={MIN_TRANSFORMERS} for Hugging Face "
            f"models (the mask functions it builds each layer's mask with), but {found} is "
            f"installed: pip install -U 'transformers>={MIN_TRANSFORMERS}', or uninstall "
            "transformers to train other models"
        )


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


check_transformers(_installed("transformers"))
