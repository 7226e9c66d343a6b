"""Server-sent events keep each event's data on one line, whatever text it carries."""
from __future__ import annotations

import json

from pagoda.entrypoints.server.serving import _sse, named_sse

TEXT = "a\u2028b\u2029c\x85d\ne\rf"


def test_an_event_is_one_data_line_whatever_its_text() -> None:
    for framed in (_sse({"text": TEXT}), named_sse({"type": "x", "text": TEXT})):
        lines = framed.splitlines()  # the strictest reader: it also breaks at U+2028, U+2029 and NEL
        data = [line for line in lines if line.startswith("data: ")]
        assert len(data) == 1 and framed.endswith("\n\n") and lines[-1] == ""
        assert json.loads(data[0][len("data: "):])["text"] == TEXT
