"""Pagoda: an LLM inference and serving engine."""
import os

# oneDNN's AMX kernels (torch's bf16 and int8 matmuls on AMX CPUs) change their summation order with the row
# count, so a request's logprobs would depend on what else is in its batch. oneDNN reads its ISA cap once, at its
# first primitive: set before torch runs one, so Pagoda's processes keep oneDNN at AVX512-BF16. A cap the user
# set wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

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
