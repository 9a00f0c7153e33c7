"""staged-engine: staged speculative decoding and DSBD for GPT-2-family models."""
from staged_engine.engine import Engine, GenerationResult
from staged_engine.sampling import SamplingParams

__all__ = ["Engine", "GenerationResult", "SamplingParams", "NGramModel"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "NGramModel":  # lazy: the n-gram module loads the C++ extension
        from staged_engine.ngram import NGramModel

        return NGramModel
    raise AttributeError(name)
