"""`pip install pagoda` without xgrammar (it is optional): structured outputs, JSON schemas and required tool calls
all run on llguidance through the server, and a backend named but missing is an error naming its package."""
from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import REPO, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
# Imported first by every Python process that has this folder on its path: xgrammar cannot be found or imported.
HIDE_XGRAMMAR = textwrap.dedent("""
    import sys
    class _HideXgrammar:
        def find_spec(self, name, path=None, target=None):
            if name == "xgrammar" or name.startswith("xgrammar."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
            return None
    sys.meta_path.insert(0, _HideXgrammar())
""")


@pytest.fixture(scope="module")
def hook_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("no_xgrammar")
    (d / "sitecustomize.py").write_text(HIDE_XGRAMMAR)
    return d


@pytest.fixture(scope="module")
def server(hook_dir: Path) -> Iterator[ServerProcess]:
    env = {"PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO), os.environ.get("PYTHONPATH", "")])}
    with ServerProcess("--kv-cache-memory", "128MiB", "--max-model-len", "1024", "--max-num-seqs", "8", env=env) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


def test_json_schema_runs_on_llguidance(server: ServerProcess, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city and its population, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
        temperature=0, max_tokens=80)
    obj = json.loads(out.choices[0].message.content)
    assert set(obj) == {"city", "population"} and isinstance(obj["population"], int)
    assert "xgrammar is not installed; compiling grammars with llguidance" in server.log_tail(200_000)


def test_choice_and_required_tools_run_on_llguidance(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert out.choices[0].text in ("blue", "green")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                         "maxLength": 16}},
                                              "required": ["city"]}}}]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
        tool_choice="required", temperature=0, max_tokens=80)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


def test_xgrammar_named_but_missing_is_an_error_naming_it(hook_dir: Path) -> None:
    import subprocess
    import sys

    code = ("from pagoda.structured.manager import backends_tried\n"
            "assert backends_tried('auto') == ('guidance',)\n"
            "try:\n    backends_tried('xgrammar')\nexcept ValueError as e:\n    print(e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook_dir), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "needs the xgrammar package, which is not installed" in out.stdout
