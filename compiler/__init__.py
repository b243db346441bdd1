"""Offline compilation: corpus sources -> decoders -> featurizers -> shard writer."""
