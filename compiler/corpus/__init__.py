"""Corpora: a SOURCE listed by its layout into inputs (records, listing helpers, layouts)."""
