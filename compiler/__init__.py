"""Offline compilation: corpus sources -> decoders -> featurizers -> shard writer.

``corpus`` lists a SOURCE by its layout into inputs; ``audio`` and ``vision`` decode
and featurize them; ``run`` processes them in work units on local processes or Dask
(``run.pipeline.compile_corpus`` is the entry point); ``output`` guards OUT and
commits what the units write. ``recipe`` holds the options, ``urls`` the storage a
compile reads and writes through, ``errors`` the compiler's errors.
"""
