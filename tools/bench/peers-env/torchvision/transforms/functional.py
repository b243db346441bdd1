def to_tensor(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("torchvision stand-in: transforms are not available here")
