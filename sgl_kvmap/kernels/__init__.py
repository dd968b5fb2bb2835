"""Operations on engines' paged KV pools. One public op per operation; callers never pick a
backend (today: the torch reference; a fused Triton / fast CPU body can replace it)."""

from .translate_pages import PagedKV, translate_pages

__all__ = ["PagedKV", "translate_pages"]
