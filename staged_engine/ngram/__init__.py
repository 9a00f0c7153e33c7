"""The n-gram draft model: the lowest stage of the drafter cascade (ALGORITHMS.md sec. 6).

``model.py`` is the public class (C++ backend, Python fallback), ``reference.py`` the pure-Python
twin of csrc/ngram.h, ``format.py`` the file format and input conversion they share. The
``ngram-build`` command lives in ``staged_engine.cli.build``.
"""
from staged_engine.ngram.format import FORMAT_VERSION, MAX_ORDER, MAX_VOCAB
from staged_engine.ngram.model import BACKEND_ENV, NGramModel, cpp_available
from staged_engine.ngram.reference import ReferenceNGram

__all__ = ["NGramModel", "ReferenceNGram", "cpp_available", "MAX_ORDER", "MAX_VOCAB", "FORMAT_VERSION",
           "BACKEND_ENV"]
