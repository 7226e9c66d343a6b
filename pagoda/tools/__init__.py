"""Tool calling: validate a request's tools, constrain the calls, read them out of the text (whole or streamed)."""
from pagoda.tools.formats import FORMATS, ToolCallFormat, choose_format, prepare_conversation, template_reads_tools
from pagoda.tools.plan import ToolPlan, plan_tools
from pagoda.tools.request import ToolRequest, parse_tools

__all__ = ["FORMATS", "ToolCallFormat", "ToolPlan", "ToolRequest", "choose_format", "parse_tools", "plan_tools",
           "prepare_conversation", "template_reads_tools"]
