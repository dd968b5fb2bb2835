"""Conventional Hub names of packs: always valid by huggingface_hub's own validator, stable,
readable when they can be, hashed when they cannot."""

from huggingface_hub.utils import HFValidationError, validate_repo_id
from hypothesis import given
from hypothesis import strategies as st

from sgl_kvmap.registry.naming import is_valid_name, pack_tags, repo_name

FP_A, FP_B = "a" * 64, "b" * 64


def test_a_plain_pair_gets_a_readable_name():
    name = repo_name(
        "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", FP_A, FP_B, "qwen2"
    )
    assert name == "kvmap-Qwen2.5-0.5B-Instruct-to-Qwen2.5-1.5B-Instruct"


def test_a_long_pair_gets_a_stable_hashed_name():
    long = "org/" + "x" * 90
    name = repo_name(long, long + "-big", FP_A, FP_B, "qwen2")
    assert name.startswith("kvmap-qwen2-") and len(name) <= 96
    assert name == repo_name(long, long + "-big", FP_A, FP_B, "qwen2")
    assert name != repo_name(long, long + "-big", FP_B, FP_A, "qwen2")


@given(
    source=st.text(min_size=1, max_size=120),
    target=st.text(min_size=1, max_size=120),
    family=st.text(max_size=30),
)
def test_every_name_passes_the_hub_validator(source, target, family):
    name = repo_name(source, target, FP_A, FP_B, family)
    validate_repo_id(f"some-org/{name}")
    assert is_valid_name(name)


@given(st.text(max_size=100))
def test_is_valid_name_agrees_with_huggingface_hub(name):
    try:
        validate_repo_id(f"org/{name}")
        hub_says = True
    except HFValidationError:
        hub_says = False
    if is_valid_name(name):
        assert hub_says, name


def test_tags_name_the_library_the_family_and_both_fingerprints():
    assert pack_tags("qwen2", FP_A, FP_B) == [
        "sgl-kvmap",
        "kv-cache",
        "qwen2",
        "kvmap-source-aaaaaaaaaaaa",
        "kvmap-target-bbbbbbbbbbbb",
    ]
