"""Opening a store in a bucket that does not exist says so, with or without ``create``.

``ins.open("s3://missing-bucket/run", create=True)`` raised a raw FileNotFoundError, and
without ``create`` told the user to run ``inshrink init``, which fails the same way. Both
now raise the library's NotFoundError naming the bucket, as the CLI already did.
"""

from __future__ import annotations

import uuid

import pytest

import inshrink_store as ins


@pytest.fixture(params=["s3", "gs"])
def missing_bucket_url(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A store URL in a bucket nobody made, on the moto S3 server or the GCS emulator."""
    request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    bucket = f"missing-bucket-{uuid.uuid4().hex[:12]}"
    return f"{request.param}://{bucket}/run", bucket


def _says_the_bucket_is_missing(error: ins.NotFoundError, url: str, bucket: str) -> None:
    text = str(error)
    assert text.startswith(f"Expected the bucket {bucket!r} of {url!r} to exist."), text
    assert "does not exist" in text and "create the bucket first" in text, text
    assert "inshrink init" not in text, text


@pytest.mark.parametrize("create", [True, False])
def test_open_in_a_missing_bucket_names_the_bucket(missing_bucket_url: tuple[str, str], create: bool) -> None:
    url, bucket = missing_bucket_url
    with pytest.raises(ins.NotFoundError) as info:
        ins.open(url, create=create)
    _says_the_bucket_is_missing(info.value, url, bucket)


def test_init_in_a_missing_bucket_names_the_bucket(missing_bucket_url: tuple[str, str]) -> None:
    url, bucket = missing_bucket_url
    with pytest.raises(ins.NotFoundError) as info:
        ins.init(url)
    _says_the_bucket_is_missing(info.value, url, bucket)


def test_an_existing_bucket_without_a_store_still_says_init(s3_url: str) -> None:
    with pytest.raises(ins.NotFoundError, match="inshrink init"):
        ins.open(s3_url)
    assert ins.open(s3_url, create=True).url == s3_url
