"""The stages after the gather: slot rings, prefetch, the device copy, state."""
