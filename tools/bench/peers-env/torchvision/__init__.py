"""Stand-in for torchvision in the peers' benchmark environment (see ../README.md)."""

__version__ = "0.0+dlop-bench-stub"
