"""staged-engine: staged speculative decoding and DSBD for GPT-2-family models."""
from .engine import Engine, GenerationResult
from .sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "NGramModel"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "NGramModel":  # lazy: the n-gram module loads the C++ extension
        from .ngram import NGramModel

        return NGramModel
    raise AttributeError(name)
