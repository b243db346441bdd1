"""Compiling a user's own preprocessing: ``compile_dataset(ds, OUT)`` for a map-style
Dataset, ``compile_map(fn, inputs, OUT)`` for a function over inputs. ``samples`` says
what a sample may be and infers the schema, ``work`` runs the code in a worker,
``code`` records what the code is, ``compiling`` drives the compile."""

from .compiling import compile_dataset, compile_map

__all__ = ["compile_dataset", "compile_map"]
