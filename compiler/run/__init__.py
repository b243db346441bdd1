"""Running a compile: inputs processed in work units, on local processes or Dask."""
