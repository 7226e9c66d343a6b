"""The formats of a linear layer's weight as the kernels take them, read from the one table both languages
share (cpu/linear_formats.h): name -> the code the C++ ops and the decoder stack dispatch on."""
from __future__ import annotations

import re
from pathlib import Path

_HEADER = Path(__file__).parent / "cpu" / "linear_formats.h"


def _read(header: Path) -> dict[str, int]:
    """'kInt4x8 = 3,' -> {'int4x8': 3}, for every enumerator of LinearFormat."""
    body = header.read_text(encoding="utf-8").split("enum LinearFormat", 1)[1].split("};", 1)[0]
    return {name.lower(): int(code) for name, code in re.findall(r"\bk(\w+)\s*=\s*(-?\d+)", body)}


LINEAR_FORMATS = _read(_HEADER)
DENSE, PANELS = LINEAR_FORMATS["dense"], LINEAR_FORMATS["panels"]  # float weights: as stored, panel-packed
# Quantized formats (PackedWeight.fmt) -> code; the panel ones are quant_panel_linear's kinds in code order.
QUANT_FORMATS = {name: code for name, code in LINEAR_FORMATS.items() if code >= 0}
PANEL_FORMATS = tuple(sorted((n for n in QUANT_FORMATS if QUANT_FORMATS[n] >= LINEAR_FORMATS["int4p"]),
                             key=QUANT_FORMATS.__getitem__))
