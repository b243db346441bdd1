from torch.utils.data import Dataset


class VisionDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("torchvision stand-in: vision datasets are not available here")
