"""Video clips and images with masks: compile speed, and the Loader against naive decoding and memcpy.

Video: H.264 clips (320x240, 30 fps, 4 s) in class folders, compiled to one
uniform 16-frame clip each at short side 128, centre crop 112 (the torchvision
video reference's shape). Images: 1024x768 JPEG cores with two annotators' PNG
masks, compiled at short side 256, centre crop 256. Each compile runs in a
fresh process, as dlop-compile does, timed from after its imports. The naive
pipelines decode and resize every sample in a DataLoader with a worker per core.
Compile and naive epoch alternate for ``repeats`` rounds; the rows give the
medians and the compile row each round's ratio. The Loader is
timed over an archive of the compiled samples repeated to ``loader_mib`` (its
speed does not depend on the pixels), against np.copyto of the same fields'
bytes.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dlop.formats import ArchiveReader, ArchiveWriter
from dlop.runtime import Loader, open_archive

from .common import Row, first_batch_ms, interleaved, loader_epoch, rate_row
from .compile_bench import timed_compile

VIDEO_SIZE = (320, 240)
VIDEO_FPS = 30
VIDEO_SECONDS = 4
CLIP_FRAMES, CLIP_SHORT, CLIP_CROP = 16, 128, 112
IMAGE_SIZE = (1024, 768)
IMAGE_SHORT, IMAGE_CROP = 256, 256
CLASSES = 4


def _scene(i: int, t: int, width: int, height: int) -> np.ndarray:
    """A moving, textured scene, cheap to make and not trivially compressible."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = 0.07 * t + i
    r = 128 + 100 * np.sin(x / (17 + i % 5) + phase)
    g = 128 + 100 * np.sin(y / (13 + i % 7) - phase)
    b = 128 + 100 * np.sin((x + y) / (23 + i % 3) + 0.5 * phase)
    img = np.stack([r, g, b], axis=-1)
    cx, cy = int((0.5 + 0.4 * np.sin(phase)) * width), int((0.5 + 0.4 * np.cos(phase)) * height)
    img[max(0, cy - 20) : cy + 20, max(0, cx - 30) : cx + 30] = (240, 240, 40)
    return img.clip(0, 255).astype(np.uint8)


def make_videos(root: Path, count: int) -> Path:
    import av

    for i in range(count):
        path = root / f"class{i % CLASSES}" / f"clip{i:05d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(path), "w") as c:
            s = c.add_stream("libx264", rate=VIDEO_FPS, options={"preset": "veryfast"})
            s.width, s.height = VIDEO_SIZE
            s.pix_fmt = "yuv420p"
            s.time_base = Fraction(1, VIDEO_FPS)
            for t in range(VIDEO_FPS * VIDEO_SECONDS):
                frame = av.VideoFrame.from_ndarray(_scene(i, t, *VIDEO_SIZE), format="rgb24")
                frame.pts = t
                for p in s.encode(frame):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
    return root


def make_images(root: Path, count: int) -> Path:
    from PIL import Image

    w, h = IMAGE_SIZE
    for d in ("images", "Maps1_T", "Maps2_T"):
        (root / d).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(_scene(i, 0, w, h)).save(root / "images" / f"core{i:05d}.jpg", quality=90)
        for a, d in enumerate(("Maps1_T", "Maps2_T")):
            blocks = rng.choice(np.array([0, 1, 3, 4, 5, 6], np.uint8), (h // 64, w // 64))
            mask = np.kron(blocks, np.ones((64, 64), np.uint8))
            Image.fromarray(mask).save(root / d / f"core{i:05d}_classimg_nonconvex{a}.png")
    return root


class NaiveClips(Dataset[tuple[torch.Tensor, int]]):
    """Per clip: PyAV decode every frame, take 16 evenly spaced, resize short side 128, crop 112."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(root.rglob("*.mp4"))
        classes = sorted({f.parent.name for f in self.files})
        self.labels = [classes.index(f.parent.name) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import av
        from PIL import Image

        with av.open(str(self.files[i])) as c:
            stream = c.streams.video[0]
            stream.thread_type = "AUTO"
            frames = list(c.decode(stream))
        pick = np.linspace(0, len(frames) - 1, CLIP_FRAMES).round().astype(int)
        out = []
        for k in pick:
            img = frames[k].to_image()
            scale = CLIP_SHORT / min(img.size)
            img = img.resize(
                (round(img.size[0] * scale), round(img.size[1] * scale)), Image.Resampling.BILINEAR
            )
            left, top = (img.size[0] - CLIP_CROP) // 2, (img.size[1] - CLIP_CROP) // 2
            out.append(np.asarray(img.crop((left, top, left + CLIP_CROP, top + CLIP_CROP))))
        return torch.from_numpy(np.stack(out)), self.labels[i]


class NaiveSegmentation(Dataset[dict[str, torch.Tensor]]):
    """Per image: Pillow decode JPEG + two PNG masks, resize short side 256 (masks nearest), crop 256."""

    def __init__(self, root: Path) -> None:
        self.images = sorted((root / "images").glob("*.jpg"))
        self.root = root

    def __len__(self) -> int:
        return len(self.images)

    @staticmethod
    def _fit(img: Any, nearest: bool) -> np.ndarray:
        from PIL import Image

        scale = IMAGE_SHORT / min(img.size)
        size = (round(img.size[0] * scale), round(img.size[1] * scale))
        img = img.resize(size, Image.Resampling.NEAREST if nearest else Image.Resampling.BILINEAR)
        left, top = (size[0] - IMAGE_CROP) // 2, (size[1] - IMAGE_CROP) // 2
        return np.asarray(img.crop((left, top, left + IMAGE_CROP, top + IMAGE_CROP)))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from PIL import Image, ImageOps

        stem = self.images[i].stem
        out = {
            "image": torch.from_numpy(
                self._fit(ImageOps.exif_transpose(Image.open(self.images[i])).convert("RGB"), False)
            )
        }
        for a, d in enumerate(("Maps1_T", "Maps2_T")):
            out[d] = torch.from_numpy(
                self._fit(Image.open(self.root / d / f"{stem}_classimg_nonconvex{a}.png"), True)
            )
        return out


def _naive_rate(dataset: Dataset[Any], batch: int, workers: int) -> tuple[float, int]:
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers)
    t0 = time.perf_counter()
    n = sum(len(b[1] if isinstance(b, list | tuple) else b["image"]) for b in loader)
    return n / (time.perf_counter() - t0), n


def _replica(archive: Path, out: Path, fields: list[str], target_bytes: int) -> tuple[Path, int]:
    """The archive's samples (only ``fields``) repeated until the archive holds ``target_bytes``."""
    with ArchiveReader(archive) as r:
        schema = [r.fields[n] for n in fields]
        samples = [{n: r.get(n, i) for n in fields} for i in range(r.num_samples)]
    per = sum(int(np.asarray(v).nbytes) for v in samples[0].values())
    count = max(len(samples), target_bytes // per)
    with ArchiveWriter(out, schema, shard_bytes=1 << 40, overwrite=True) as w:
        for i in range(count):
            w.write(samples[i % len(samples)])
    return out, per


def _loader_rows(
    workload: str, path: Path, fields: list[str], batch: int, repeats: int, naive: Row
) -> list[Row]:
    ds = open_archive(path, fields=fields)
    n = len(ds)
    shard = ds.shards[0]
    per = sum(int(shard.array(f).nbytes) for f in fields) / n
    regions = [shard.array(f) for f in fields]
    targets = [np.empty_like(a) for a in regions]
    for t in targets:
        t.fill(0)  # first touch outside the timing

    def copy_all() -> None:
        for src, dst in zip(regions, targets, strict=True):
            np.copyto(dst, src)

    loader = Loader(ds, batch, seed=0)
    first_ms = first_batch_ms(loader)
    sync = Loader(ds, batch, seed=0, prefetch=0)
    took = interleaved(
        {
            "memcpy": copy_all,
            "loader": lambda: loader_epoch(loader),
            "sync": lambda: loader_epoch(sync),
        },
        repeats,
    )
    loader.close()
    sync.close()
    memcpy = rate_row(
        workload, "np.copyto of the same fields' bytes (memcpy)", n, took["memcpy"], per
    )
    row = rate_row(
        workload,
        f"dlop Loader ({', '.join(fields)})",
        n,
        took["loader"],
        per,
        memcpy,
        "memcpy",
        first_batch_ms=first_ms,
        target=">=0.9x",
    )
    row.extra["vs_naive"] = _vs_naive(row, naive)
    row0 = rate_row(
        workload,
        "dlop Loader, prefetch=0 (gathers on the training thread)",
        n,
        took["sync"],
        per,
        memcpy,
        "memcpy",
    )
    row0.extra["vs_naive"] = _vs_naive(row0, naive)
    return [memcpy, row, row0, naive]


def _vs_naive(row: Row, naive: Row) -> float | None:
    """The row's rate over the naive pipeline's, rounded for the table."""
    if not row.samples_per_s or not naive.samples_per_s:
        return None
    return round(row.samples_per_s / naive.samples_per_s, 1)


def _workload(
    work: Path,
    name: str,
    wl: str,
    corpus: Path,
    options: dict[str, Any],
    sample_bytes: int,
    naive: tuple[str, Dataset[Any], int],
    fields: list[str],
    batch: int,
    args: tuple[int, int, int],
    **compile_extra: Any,
) -> list[Row]:
    """Compile, the naive pipeline's epoch, and the Loader rows of one media workload."""
    workers, repeats, loader_mib = args
    raw_bytes = sum(f.stat().st_size for f in corpus.rglob("*") if f.is_file())
    # Compile (in a fresh process, as dlop-compile runs) and the naive epoch in
    # interleaved rounds: medians, with each round's ratio.
    archive = work / f"{name}-archive"
    label, dataset, naive_batch = naive
    compiled, naive_rates = [], []
    samples = 0
    for _ in range(repeats):
        timed = timed_compile({"source": str(corpus), **options}, archive, workers)
        samples = timed.samples
        compiled.append(samples / timed.seconds)
        naive_rates.append(_naive_rate(dataset, naive_batch, workers)[0])
    rate, naive_rate = statistics.median(compiled), statistics.median(naive_rates)
    ratios = sorted(c / n for c, n in zip(compiled, naive_rates, strict=True))
    extra = {k: round(v * rate) for k, v in compile_extra.items()}
    naive_row = Row(wl, f"{label} ({workers} workers)", naive_rate, naive_rate * sample_bytes / 1e9)
    rows = [
        Row(
            wl,
            f"dlop-compile ({workers} workers)",
            rate,
            rate * sample_bytes / 1e9,
            rate / naive_rate,
            "naive epoch",
            {
                **extra,
                "rounds": repeats,
                "round_ratios": [round(r, 2) for r in ratios],
                "corpus_MiB": round(raw_bytes / 2**20, 1),
                "archive_MiB": round(
                    sum(p.stat().st_size for p in archive.glob("*.dlop")) / 2**20, 1
                ),
            },
        ),
        naive_row,
    ]
    replica, _ = _replica(
        work / f"{name}-archive", work / f"{name}-replica", fields, loader_mib << 20
    )
    wl2 = f"{wl}, compiled samples repeated to {loader_mib} MiB, shuffled batches of {batch}"
    naive2 = Row(wl2, rows[-1].pipeline, rows[-1].samples_per_s, rows[-1].gb_per_s)
    rows += _loader_rows(wl2, replica, fields, batch, repeats, naive2)
    shutil.rmtree(work / f"{name}-replica", ignore_errors=True)
    return rows


def run(
    work: Path, videos: int, images: int, workers: int, repeats: int, loader_mib: int
) -> list[Row]:
    rows: list[Row] = []
    args = (workers, repeats, loader_mib)
    if videos:
        print(f"   video corpus: {videos} clips", file=sys.stderr, flush=True)
        corpus = make_videos(work / "videos", videos)
        rows += _workload(
            work,
            "video",
            f"video: {videos} H.264 clips {VIDEO_SIZE[0]}x{VIDEO_SIZE[1]} {VIDEO_FPS} fps "
            f"{VIDEO_SECONDS} s -> uint8 [{CLIP_FRAMES},{CLIP_CROP},{CLIP_CROP},3]",
            corpus,
            {"clip_frames": CLIP_FRAMES, "size": CLIP_SHORT, "crop": CLIP_CROP},
            CLIP_FRAMES * CLIP_CROP * CLIP_CROP * 3,
            ("naive per-clip PyAV decode + resize DataLoader", NaiveClips(corpus), 8),
            ["frames", "label"],
            32,
            args,
            stored_frames_per_s=CLIP_FRAMES,
            source_frames_per_s=VIDEO_FPS * VIDEO_SECONDS,
        )
    if images:
        print(f"   image corpus: {images} images with 2 masks each", file=sys.stderr, flush=True)
        corpus = make_images(work / "images", images)
        rows += _workload(
            work,
            "image",
            f"images: {images} JPEG {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} + 2 PNG masks -> "
            f"uint8 [{IMAGE_CROP},{IMAGE_CROP},3] + 2 x [{IMAGE_CROP},{IMAGE_CROP}]",
            corpus,
            {"size": IMAGE_SHORT, "crop": IMAGE_CROP},
            IMAGE_CROP * IMAGE_CROP * 5,
            ("naive per-image Pillow decode + resize DataLoader", NaiveSegmentation(corpus), 32),
            ["image", "Maps1_T", "Maps2_T"],
            64,
            args,
        )
    return rows
