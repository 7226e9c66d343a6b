"""The formats of a linear layer's weight as the kernels take them, read from the one table both languages
share (cpu/linear_formats.h): name -> the code the C++ ops and the decoder stack dispatch on."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

_HEADER = Path(__file__).parent / "cpu" / "linear_formats.h"

QuantFormat = Literal["int4", "int8", "fp8", "gguf"]  # what one code is (PackedWeight.format; gguf: gguf_blocks.py)
# How the codes are laid out (PackedWeight.layout): rows as stored; INT4 in blocks of 8 interleaved rows for the
# INT8-activation kernel (VNNI, AVX2 or Arm sdot); INT4 rows as stored for the INT8-activation kernel of the other
# shapes (rows_a8: the same bytes, read by another kernel); panels of 16 output columns for the bf16 panel kernel;
# panels of the build's 2W columns for the portable panel kernel (vpanels).
Layout = Literal["rows", "interleave8", "rows_a8", "panels16", "vpanels"]


def _read(header: Path) -> dict[str, int]:
    """'kInt4x8 = 3,' -> {'int4x8': 3}, for every enumerator of LinearFormat."""
    body = header.read_text(encoding="utf-8").split("enum LinearFormat", 1)[1].split("};", 1)[0]
    return {name.lower(): int(code) for name, code in re.findall(r"\bk(\w+)\s*=\s*(-?\d+)", body)}


LINEAR_FORMATS = _read(_HEADER)
DENSE, PANELS = LINEAR_FORMATS["dense"], LINEAR_FORMATS["panels"]  # float weights: as stored, panel-packed
# A quantized weight's code by (format, layout): the one place the header's names for them are spelled.
QUANT_CODES: dict[tuple[QuantFormat, Layout], int] = {
    ("int4", "rows"): LINEAR_FORMATS["int4"],
    ("int8", "rows"): LINEAR_FORMATS["int8"],
    ("fp8", "rows"): LINEAR_FORMATS["fp8"],
    ("int4", "interleave8"): LINEAR_FORMATS["int4x8"],
    ("int4", "rows_a8"): LINEAR_FORMATS["int4a8"],
    ("int4", "panels16"): LINEAR_FORMATS["int4p"],
    ("int8", "panels16"): LINEAR_FORMATS["int8p"],
    ("fp8", "panels16"): LINEAR_FORMATS["fp8p"],
    ("int4", "vpanels"): LINEAR_FORMATS["int4v"],
    ("int8", "vpanels"): LINEAR_FORMATS["int8v"],
    ("fp8", "vpanels"): LINEAR_FORMATS["fp8v"],
    ("gguf", "rows"): LINEAR_FORMATS["gguf"],
    ("gguf", "vpanels"): LINEAR_FORMATS["ggufv"],
}
# The drivers that read gguf vpanels (PackedWeight.gguf_driver) and their codes where not the vpanels' own.
GgufDriver = Literal["float", "amx", "int8"]
GGUF_DRIVER_CODES: dict[GgufDriver, int] = {"amx": LINEAR_FORMATS["ggufa"], "int8": LINEAR_FORMATS["ggufi8"]}
# quant_panel_linear's `kind` is a panel code minus this one (as decoder_stack.cpp computes it).
FIRST_PANEL_CODE = LINEAR_FORMATS["int4p"]
FIRST_VPANEL_CODE = LINEAR_FORMATS["int4v"]  # and quant_vpanel_linear's
