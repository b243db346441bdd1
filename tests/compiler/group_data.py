"""Functions for field group tests: importable, so worker processes (forked, from a fork
server, or Dask's) find them by name."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch


def base_sample(i: int) -> dict[str, Any]:
    """An archive's sample: a fixed field, a ragged one, a label and a name."""
    return {
        "x": np.arange(4, dtype=np.float32) + i,
        "wave": np.full(3 + i % 5, i, np.int16),
        "label": i % 7,
        "name": f"clip-{i:04d}",
    }


def embed(sample: dict[str, Any]) -> dict[str, Any]:
    """New fields from a sample's stored ones: fixed, ragged, str, and a random draw (seeded
    from the sample's number)."""
    x = sample["x"]
    wave = sample["wave"]
    return {
        "emb": torch.cat([x * 2, x.sum().reshape(1)]),
        "pitch": wave.to(torch.float32)[: 1 + int(sample["label"])] / 2,
        "tag": sample["name"].upper(),
        "noise": torch.rand(2),
    }


def embed_expected(i: int) -> dict[str, Any]:
    """What embed gives for base_sample(i), noise aside."""
    s = base_sample(i)
    x = s["x"]
    return {
        "emb": np.concatenate([x * 2, [x.sum()]]).astype(np.float32),
        "pitch": (s["wave"].astype(np.float32)[: 1 + s["label"]] / 2),
        "tag": s["name"].upper(),
    }


def fails_at_37(sample: dict[str, Any]) -> dict[str, Any]:
    if int(sample["x"][0]) == 37:
        raise ValueError("no pitch for this one")
    return {"y": sample["x"] + 1}


def not_a_dict(sample: dict[str, Any]) -> Any:
    return sample["x"] + 1


def double(sample: dict[str, Any]) -> dict[str, Any]:
    return {"double": sample["x"] * 2}


def quadruple(sample: dict[str, Any]) -> dict[str, Any]:
    return {"double": sample["x"] * 4}


def clashes(sample: dict[str, Any]) -> dict[str, Any]:
    return {"label": sample["x"]}


def exits(sample: dict[str, Any]) -> dict[str, Any]:
    if int(sample["x"][0]) == 20:
        os._exit(3)
    return {"y": sample["x"] + 1}


def widens(sample: dict[str, Any]) -> dict[str, Any]:
    """Fixed length in the first samples (what the schema is inferred from), longer later."""
    n = 2 if int(sample["x"][0]) < 30 else 3
    return {"y": torch.ones(n) * sample["x"][0]}


def slow_embed(sample: dict[str, Any]) -> dict[str, Any]:
    """embed, slowly: a compile of it lasts long enough to be killed halfway."""
    time.sleep(0.004)
    return embed(sample)


def longer_later(sample: dict[str, Any]) -> dict[str, Any]:
    """Two values for the first 300 samples, three after: fixed until an append."""
    n = 2 if int(sample["x"][0]) < 300 else 3
    return {"y": torch.ones(n) * sample["x"][0]}


def lengths_of_wave(sample: dict[str, Any]) -> dict[str, Any]:
    return {"wave_lengths": sample["x"]}


def lengths_later(sample: dict[str, Any]) -> dict[str, Any]:
    """``y`` fixed in the first samples, longer later (made ragged), beside ``y_lengths``."""
    n = 2 if int(sample["x"][0]) < 30 else 3
    return {"y": torch.ones(n), "y_lengths": torch.zeros(1)}


def spoken(sample: dict[str, Any]) -> dict[str, Any]:
    return {"said": f"sample {int(sample['x'][0])}"}


def spoken_again(sample: dict[str, Any]) -> dict[str, Any]:
    return {"said": f"again {int(sample['x'][0])}"}


def hangs(sample: dict[str, Any]) -> dict[str, Any]:
    if int(sample["x"][0]) == 20:
        time.sleep(3600)
    return {"y": sample["x"] + 1}
