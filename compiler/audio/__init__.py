"""Audio: decoding, resampling, and the featurizers with their presets and kernels."""
