"""What a chat request's tools change about its generation: the constraint, and how its output is read."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagoda.sampling_params import SamplingParams
from pagoda.structured.params import StructuredOutputsParams
from pagoda.tools.formats import ToolCallFormat
from pagoda.tools.parser import ArgumentsReader, ArrayReader, Reader, ToolCallStream, parse_calls
from pagoda.tools.request import ToolRequest


@dataclass(frozen=True)
class ToolPlan:
    reader: Reader
    constraint: StructuredOutputsParams | None  # replaces the request's own (None: keep it)
    constrained: bool  # every call is grammar-constrained, so its arguments stream as written
    max_calls: int | None  # 1 when parallel_tool_calls is false
    keep_special_tokens: bool

    def apply(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling parameters with this plan's constraint (and the call's control token kept)."""
        return dataclasses.replace(params, structured_outputs=self.constraint or params.structured_outputs,
                                   skip_special_tokens=params.skip_special_tokens and not self.keep_special_tokens)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.reader, self.constrained, self.max_calls)

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        return parse_calls(self.reader, text, self.max_calls)


def plan_tools(tools: ToolRequest | None, fmt: ToolCallFormat,
               response_format: StructuredOutputsParams | None) -> ToolPlan | None:
    """None when the output is not read for calls (no tools, or tool_choice none). ValueError when the
    request's own constraint cannot hold beside a forced call."""
    if tools is None or not tools.calls_expected:
        return None
    max_calls = None if tools.parallel else 1
    forced = tools.forced_constraint()
    if forced is not None:
        if response_format is not None:
            raise ValueError("tool_choice: 'required' or a named function cannot be combined with "
                             "response_format or structured_outputs")
        reader: Reader = ArgumentsReader(tools.named) if tools.choice == "named" else ArrayReader()
        return ToolPlan(reader, forced, True, max_calls, False)
    # auto: the model's own syntax, each call constrained from its opening text on. A request that brings
    # its own constraint keeps it (the calls are then read unconstrained).
    tag = fmt.structural_tag(tools.functions) if response_format is None else None
    constraint = StructuredOutputsParams(structural_tag=tag) if tag is not None else None
    return ToolPlan(fmt.reader, constraint, constraint is not None, max_calls, fmt.keep_special_tokens)
