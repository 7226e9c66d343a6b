"""The structural tag tool_choice=auto compiles to, on both grammar backends: text is free until a call
opens, then the call's name and arguments are forced to the function's schema, then text is free again."""
from __future__ import annotations

import pytest

from pagoda import LLM
from pagoda.config import StructuredOutputsConfig
from pagoda.structured.manager import StructuredOutputManager
from pagoda.tools import parse_tools, plan_tools
from pagoda.tools.formats import HERMES, LLAMA3_JSON

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}


def _accepts(matcher, tokenizer, text: str) -> bool:  # noqa: ANN001
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("fmt, opening, body", [
    (HERMES, "Let me check. <tool_call>", '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    (LLAMA3_JSON, '{"name": "', 'get_weather", "parameters": {"city": "Oslo"}}'),
])
def test_auto_constrains_a_call_from_its_opening_on(smollm_llm: LLM, backend: str, fmt, opening: str,  # noqa: ANN001
                                                     body: str) -> None:
    tok = smollm_llm.engine.tokenizer
    manager = StructuredOutputManager(tok, smollm_llm.engine.args.vocab_size, StructuredOutputsConfig(backend=backend))
    plan = plan_tools(parse_tools([TOOL], "auto", None), fmt, None)
    grammar = manager.compile(plan.constraint).result()
    free = manager.matcher(grammar)
    assert _accepts(free, tok, "Any text at all, {braces} and <tags>.")  # before a call: free text
    m = manager.matcher(grammar)
    assert _accepts(m, tok, opening)
    assert body.startswith(m.forced_string()) and len(m.forced_string()) > 5  # the name is forced
    bad = manager.matcher(grammar)
    assert _accepts(bad, tok, opening)
    wrong = body.replace('"city"', '"town"')
    assert not _accepts(bad, tok, wrong)  # an argument the schema does not have
    assert _accepts(m, tok, body)
    assert _accepts(m, tok, " Done.")  # after the call: free text again
