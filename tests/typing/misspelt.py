"""spelt.py with a mistake of each kind, which ``make lint`` requires ``mypy --strict``
to report: a misspelt shared setting, a misspelt keyword of a front end's own, a
setting of the wrong type, and a word a setting does not take."""

from dlop.runtime import IterableArchive, Loader

loader = Loader("a.dlop", 64, shufle=False, seed="3", prefetch=1, cache_bytes=1 << 30)
iterable = IterableArchive("a.dlop", 64, order="windows", bucket_by="speech", worker_bufers=2)
