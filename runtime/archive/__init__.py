"""The archive as a map-style Dataset: opening, selections, several archives as one."""
