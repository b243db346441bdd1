"""Where a compile writes: OUT guarded, its journal, units' commit records, index and store."""
