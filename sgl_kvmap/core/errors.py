"""Exceptions a user can cause. Each message says what differs and what to do."""


class KVMapError(Exception):
    """Base class of every error sgl-kvmap raises on purpose."""


class PairMismatchError(KVMapError):
    """The two models cannot form a pair (tokenizers differ) or a pack belongs to another pair."""


class PackError(KVMapError):
    """A mapper pack folder is missing, damaged, tampered with or of an unknown format."""


class ModelSourceError(KVMapError):
    """A model could not be found, fetched, verified or converted (a folder or Hub id that is
    neither there nor reachable, or the embedded default pair)."""
