"""Page records (sgl_kvmap/sglang/records.py): a whole record or none."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sgl_kvmap.core.errors import KVMapError
from sgl_kvmap.sglang.pages import PageFormat
from sgl_kvmap.sglang.records import RECORD_BYTES, PageRecord

PAGE = PageFormat("page_first", 64, 28, 2, 128, torch.bfloat16)
IDENTITY = "a" * 32 + ":" + "b" * 32


def record(**changes) -> PageRecord:
    fields = dict(index=3, parent="p" * 64, page=PAGE, tp_rank=0, tp_size=1, model=IDENTITY)
    return PageRecord(**{**fields, "crc32": 1234, **changes})


def edited(data: torch.Tensor, **fields) -> torch.Tensor:
    """The stored record with some JSON fields changed, its checksum left as it was."""
    parsed = json.loads(bytes(data.numpy()).decode())
    parsed.update(fields)
    text = json.dumps(parsed, sort_keys=True).encode().ljust(RECORD_BYTES)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def test_a_record_round_trips():
    assert PageRecord.from_tensor(record().to_tensor()) == record()


@pytest.mark.parametrize(
    "change",
    [
        {"page": {**PAGE.to_dict(), "dtype": "float16"}},  # bytes read as another dtype
        {"index": 10**15},
        {"model": "c" * 32 + ":" + "b" * 32},
        {"crc32": 99},
    ],
)
def test_a_changed_field_fails_the_records_checksum(change):
    with pytest.raises(KVMapError, match="checksum"):
        PageRecord.from_tensor(edited(record().to_tensor(), **change))


def test_a_record_of_another_version_is_refused():
    with pytest.raises(KVMapError, match="version-2"):
        PageRecord.from_tensor(edited(record().to_tensor(), version=1))


def test_only_the_first_page_has_no_parent():
    with pytest.raises(KVMapError, match="first page"):
        dataclasses.replace(record(), parent="")
