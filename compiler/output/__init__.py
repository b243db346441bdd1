"""Where a compile writes: the guarded output folder, its journal, commits and store."""
