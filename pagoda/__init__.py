"""Pagoda: an LLM inference and serving engine."""
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.structured.params import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing pagoda stays cheap
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
