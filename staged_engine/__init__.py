"""staged-engine: staged speculative decoding and DSBD for GPT-2-family models."""
__all__ = ["Engine", "GenerationResult", "SamplingParams", "NGramModel"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: importing the package (as the command line does to print its help) loads neither
    # torch nor the C++ extensions; the first use of a name does.
    if name in ("Engine", "GenerationResult"):
        from staged_engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from staged_engine.sampling import SamplingParams

        return SamplingParams
    if name == "NGramModel":
        from staged_engine.ngram import NGramModel

        return NGramModel
    raise AttributeError(f"module 'staged_engine' has no attribute {name!r}")
