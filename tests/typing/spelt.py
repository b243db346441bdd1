"""A training script's calls, as ``make lint`` type-checks them: this one passes
``mypy --strict`` (its twin misspelt.py must not)."""

from dlop.runtime import IterableArchive, Loader

loader = Loader("a.dlop", 64, shuffle=False, seed=3, prefetch=1, cache_bytes=1 << 30)
iterable = IterableArchive("a.dlop", 64, order="window", bucket_by="speech", worker_buffers=2)
