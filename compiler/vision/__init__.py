"""Video and images: clip sampling, resizing, masks and their options."""
