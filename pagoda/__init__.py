"""Pagoda: an LLM inference and serving engine."""
from pagoda.process_env import apply_defaults

apply_defaults()  # before torch is imported and starts its thread pool and oneDNN

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.structured.params import StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing pagoda stays cheap
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
