"""Which samples each batch holds: epoch orders, ranks, mixtures."""
