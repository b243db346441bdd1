"""Copying a batch's samples into buffers: field gathers, copy plans, the engine."""
