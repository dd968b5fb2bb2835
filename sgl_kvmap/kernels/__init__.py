"""Operations on engines' paged KV pools. One public op per operation; its body is chosen by
where the pools live (Triton for GPU pools, torch for host memory), never by the caller."""

from .translate_pages import BACKENDS, PagedKV, translate_pages

__all__ = ["BACKENDS", "PagedKV", "translate_pages"]
