"""Running Hugging Face models: capture caches (``capture``), hand a prefix from one model to
another (``transfer``), time a hand-off against re-prefill (``timing``). The only code that
runs models; built on ``sgl_kvmap.core``."""
