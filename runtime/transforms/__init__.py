"""Seeded augmentations run on the batch's device (audio, video, images)."""
