"""Operations on engines' paged KV pools. One public op per operation; its body is chosen by
where the pools live (Triton for GPU pools, torch for host memory), never by the caller."""

from .matmul import fast_matmul_dtype
from .translate_pages import BACKENDS, PagedKV, translate_pages

__all__ = ["BACKENDS", "PagedKV", "fast_matmul_dtype", "translate_pages"]
