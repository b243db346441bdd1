"""Training-time loading: open archives, order, gather, transfer, augment."""
