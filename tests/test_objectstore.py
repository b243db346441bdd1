def test_s3_roundtrip(s3):
    url = s3.make_bucket("bucket")
    fs = s3.filesystem()
    fs.pipe("bucket/x", b"hello")
    assert fs.cat("bucket/x") == b"hello"
    import fsspec

    with fsspec.open(url + "/x", "rb") as f:  # environment-configured client
        assert f.read() == b"hello"
