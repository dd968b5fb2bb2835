"""Fitting and judging maps on real text: text (``texts``), calibration (``calibrate``),
downstream tuning (``tune``), evaluation beside every baseline (``evaluate``) and the embedded
default pair (``default_pair``). Built on ``sgl_kvmap.core`` and ``sgl_kvmap.models``."""
